"""``xfam knnlm build`` / ``xfam knnlm eval``: kNN-LM (Khandelwal et al., 2020) over a trained checkpoint.

    xfam knnlm build ckpt=PATH [split=train] [out=DIR] [limit=N] [dtype=float16]
    xfam knnlm eval ckpt=PATH store=DIR [split=test] [k=1024] [lambda=0.25] [temperature=1.0] [index=exact]

``build`` stores the key (the final layer's FFN input, after its norm) and the next token of every
target position of a split; ``eval`` reports the base model's loss / perplexity / bits per byte and
those of ``p = λ p_kNN + (1 - λ) p_LM``. See docs/memory.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xfam.cli.grammar import Args

INDEXES = ["exact", "faiss"]  # xfam.knnlm.search.INDEXES (not imported: `xfam --help` stays free of torch)


def run(args: Args) -> None:
    """``xfam knnlm build`` or ``xfam knnlm eval`` (``args.step``), as ``xfam.cli.commands`` declares them."""
    from xfam.eval.knnlm import build_datastore, score

    if args.step == "build":
        path = build_datastore(
            args.ckpt,
            args.split,
            args.out,
            limit=args.limit,
            batch_size=args.batch_size,
            device=args.device,
            dtype=args.dtype,
            overwrite=args.overwrite,
        )
        from xfam.knnlm.datastore import read_manifest

        m = read_manifest(path)
        print(f"datastore {path}: {m['count']} entries of dim {m['dim']} ({m['key_dtype']} keys)")
        print(
            f"  from {m['checkpoint']['path']} (step {m['checkpoint']['step']}), split {m['split']}, "
            f"{m['batches']} batches"
        )
        return
    lam = vars(args)["lambda"]
    scorer, about = score(
        args.ckpt,
        args.store,
        args.split,
        ks=[args.k],
        lambdas=[lam],
        temperature=args.temperature,
        index=args.index,
        batch_size=args.batch_size,
        limit=args.limit,
        device=args.device,
    )
    metrics = scorer.metrics(args.split)
    own = ", own entries excluded" if about["exclude_self"] else ""
    print(
        f"{args.ckpt} on {args.split} ({about['batches']} batches) with kNN-LM over {args.store} "
        f"({about['store_size']} entries{own}); k={args.k} lambda={lam} temperature={args.temperature} "
        f"index={args.index}:"
    )
    for key, value in metrics["base"].items():
        print(f"  {key:<28} {value:.4f}")
    for key, value in metrics[(args.k, lam)].items():
        name = key.replace(f"{args.split}/", f"{args.split}/knnlm/", 1)
        print(f"  {name:<28} {value:.4f}")
