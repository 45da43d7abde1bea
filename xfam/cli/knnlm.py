"""``xfam knnlm build`` / ``xfam knnlm eval``: kNN-LM (Khandelwal et al., 2020) over a trained checkpoint.

    xfam knnlm build ckpt=PATH [split=train] [out=DIR] [limit=N] [dtype=float16]
    xfam knnlm eval ckpt=PATH store=DIR [split=test] [k=1024] [lambda=0.25] [temperature=1.0] [index=exact]

``build`` stores the key (the final layer's FFN input, after its norm) and the next token of every
target position of a split; ``eval`` reports the base model's loss / perplexity / bits per byte and
those of ``p = λ p_kNN + (1 - λ) p_LM``. See docs/memory.md.
"""

from __future__ import annotations

import argparse

SPLITS = ["train", "validation", "test"]
INDEXES = ["exact", "faiss"]  # xfam.knnlm.search.INDEXES (not imported: `xfam --help` stays free of torch)


def add_parsers(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``knnlm`` subcommand and its ``build`` / ``eval`` subcommands (options as key=value)."""
    knn = sub.add_parser(
        "knnlm",
        help="kNN-LM: build a datastore from a checkpoint, evaluate the interpolation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    steps = knn.add_subparsers(dest="step", required=True, metavar="{build,eval}")
    p = steps.add_parser("build", help="keys and next tokens of a split of the checkpoint's data")
    p.add_argument("--ckpt", required=True, help="checkpoint file (.ckpt) of a language model")
    p.add_argument("--split", default="train", choices=SPLITS, help="the text the datastore memorises")
    p.add_argument("--out", default=None, help="datastore directory (default: <run dir>/knnlm/<ckpt>_<split>)")
    p.add_argument("--limit", type=int, default=None, help="at most this many batches of the split")
    p.add_argument("--batch_size", type=int, default=None, help="default: the run's data.batch_size")
    p.add_argument(
        "--dtype", default="float16", choices=["float16", "float32"], help="key storage (the authors' code: fp16)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing datastore in out")
    p.add_argument("--device", default="cpu")
    p = steps.add_parser("eval", help="the base model and kNN-LM on a split (loss, perplexity, bits per byte)")
    p.add_argument("--ckpt", required=True, help="checkpoint file (.ckpt) the datastore was built from")
    p.add_argument("--store", required=True, help="datastore directory written by `xfam knnlm build`")
    p.add_argument("--split", default="test", choices=SPLITS, help="the store's own split: own entries excluded")
    p.add_argument("--k", type=int, default=1024, help="neighbours retrieved (paper: 1024)")
    p.add_argument("--lambda", type=float, default=0.25, help="weight of p_kNN (paper, WikiText-103: 0.25)")
    p.add_argument("--temperature", type=float, default=1.0, help="p_kNN ∝ exp(-d / temperature) (paper: 1)")
    p.add_argument("--index", default="exact", choices=INDEXES, help="exact: torch; faiss: IndexFlatL2")
    p.add_argument("--batch_size", type=int, default=None, help="default: the run's data.batch_size")
    p.add_argument("--limit", type=int, default=None, help="evaluate at most this many batches")
    p.add_argument("--device", default="cpu")
    return knn


def run(args: argparse.Namespace) -> None:
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
