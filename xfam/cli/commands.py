"""Every ``xfam`` subcommand, declared in the shared grammar (``xfam.cli.grammar``): its options with their
types, defaults, help and checks, and the function that runs it. A new subcommand is one more ``Command``
here (its implementation in a module of its own, imported only when it runs: ``xfam --help`` stays quick).

One file over 400 lines: every subcommand's declaration in one place, read together as the command's reference.
"""

from __future__ import annotations

import os

from xfam.cli import knnlm
from xfam.cli.grammar import (
    BOOL,
    FLOAT,
    INT,
    PATH,
    STR,
    Args,
    Choice,
    Command,
    Group,
    ListOf,
    Option,
    Passthrough,
    at_least,
    finite,
    must,
)
from xfam.core.errors import ConfigError
from xfam.model.exported import is_exported
from xfam.model.sharded import is_sharded

SPLITS = Choice("train", "validation", "test")
CKPT_EXAMPLE = "runs/<name>/<run>/checkpoints/last.ckpt"


def checkpoint_file(option: Option, value: str) -> str | None:
    """A checkpoint must be an existing file, a sharded checkpoint's folder or an exported model folder (``xfam
    export``; checked before anything is loaded)."""
    if os.path.isfile(value) or is_sharded(value) or is_exported(value):
        return None
    what = (
        "is a folder but neither a sharded checkpoint (no meta.pt) nor an exported model (no config.json)"
        if os.path.isdir(value)
        else "does not exist"
    )
    return (
        f"{option.name}={value!r} {what}. Fix: pass the path of a .ckpt file, of a sharded checkpoint's folder or of "
        f"a folder written by `xfam export`, e.g. {option.name}={CKPT_EXAMPLE}."
    )


def training_checkpoint(option: Option, value: str) -> str | None:
    """``checkpoint_file``, but not an exported model folder: the command needs what only a training checkpoint
    holds (its optimizer and loop state, or the checkpoint to export)."""
    if is_exported(value) and not is_sharded(value):
        return (
            f"{option.name}={value!r} is an exported model folder (`xfam export`), which holds no training state. "
            f"Fix: pass the training checkpoint it was exported from (a .ckpt file or a sharded checkpoint's folder)."
        )
    return checkpoint_file(option, value)


def device_name(option: Option, value: str) -> str | None:
    """A torch device this machine has (cpu, cuda, cuda:1, mps)."""
    import torch

    try:
        kind = torch.device(value).type
    except (RuntimeError, ValueError):
        return f"{option.name}={value!r} is not a device name. Fix: device=cpu, or device=cuda (cuda:1 ...)."
    if kind == "cuda" and not torch.cuda.is_available():
        return f"{option.name}={value!r}, and this machine has no CUDA GPU. Fix: device=cpu."
    if kind == "mps" and not torch.backends.mps.is_available():
        return f"{option.name}={value!r}, and this machine has no MPS device. Fix: device=cpu."
    return None


POSITIVE = must("an integer >= 1", at_least(1))


def ckpt(help: str = "checkpoint: a .ckpt file, or a folder (sharded, or written by xfam export)") -> Option:
    return Option("ckpt", PATH, help=help, required=True, check=checkpoint_file, example=CKPT_EXAMPLE)


def training_ckpt(help: str) -> Option:
    """``ckpt`` of a command that needs a training checkpoint (not an exported model folder)."""
    return Option("ckpt", PATH, help=help, required=True, check=training_checkpoint, example=CKPT_EXAMPLE)


def batch_size() -> Option:
    return Option("batch_size", INT, None, "default: the run's data.batch_size", check=POSITIVE, example="8")


def limit(help: str = "evaluate at most this many batches") -> Option:
    return Option("limit", INT, None, help, check=POSITIVE, example="10")


DEVICE = Option("device", STR, "cpu", "torch device: cpu, cuda, cuda:1, mps", check=device_name)
EXIT = Passthrough(
    "exit",
    help="inference options of an early-exit policy, e.g. exit.threshold=0.8 exit.measure=saturation",
    what="an early-exit model's inference option",
    example="exit.threshold=0.8",
)

TRAIN = Command(
    "train",
    "train a model: train.py's job from any directory (Hydra overrides; `xfam train --help`)",
    run="xfam.cli.train:run",
    raw=True,
)

LIST = Command(
    "list",
    "components, their parameters and capabilities, compatibility",
    (
        Option("markdown", BOOL, False, "print the slot table in markdown instead"),
        Option("plugins", ListOf(STR), [], "modules that register components (as train's +plugins=[...])"),
    ),
    run="xfam.cli.listing:run",
)

EVAL_DESCRIPTION = """\
Metrics of a checkpoint on a split of its data, as the run's own validation and test computed them (a
memory model's memory carried from batch to batch). Evaluation lengths, for length extrapolation
(Press et al., 2022, arXiv:2108.12409, non-overlapping rows):
  seq_len=N   the checkpoint's data rebuilt with data.seq_len=N. A learned position table (pos=learned)
              has model.max_len rows: a longer N is refused.
  mem_len=M   each layer's memory keeps M states in evaluation: eval_mem_len of memory=xl and spalm
              (mem_len stays the trained one), mem_len of compressive (uncompressed memory) and
              memorizing (its local cache). Refused for a model without memory.
The first line of the report names the lengths used and, where they differ, the trained ones."""

EVAL = Command(
    "eval",
    "evaluate a checkpoint on a split of its data",
    (
        ckpt(),
        Option("split", SPLITS, "test", "the split of the checkpoint's data"),
        batch_size(),
        limit(),
        Option(
            "seq_len", INT, None, "evaluation length: the data rebuilt at data.seq_len=N", check=POSITIVE, example="512"
        ),
        Option(
            "mem_len",
            INT,
            None,
            "memory models: states each layer's memory keeps (eval_mem_len, else mem_len)",
            check=must("an integer >= 0", at_least(0)),
            example="256",
        ),
        DEVICE,
    ),
    run="xfam.cli.evaluate:run",
    passthrough=EXIT,
    description=EVAL_DESCRIPTION,
)

GENERATE_DESCRIPTION = """\
Which checkpoints generate, and how (xfam.eval.generate):
  causal LM, no memory    the prompt in one call, then one call per token with the KV cache (or each
                          mechanism's decode state); an early-exit model picks each token's depth.
                          With learned positions (pos=learned) prompt + max_new_tokens <= model.max_len.
                          decoder=auto: a preallocated cache and a compiled one-token step where the
                          model supports it and the run is long enough to repay compiling (batch x
                          new tokens >= 2048, or already compiled in the process); else the eager
                          growing cache. The log says which ran and why (docs/decoding.md).
  causal LM with memory   memory=xl, compressive, memorizing, spalm: the memory is carried as in training.
                          The stream is cut into segments of the run's data.seq_len; each completed
                          segment writes the memory. Inside the current one, xl and compressive decode
                          one token per call against a cache that starts with the memory; memorizing,
                          spalm and runs with data.doc_mask recompute the segment at every step (no
                          length limit; documents end at eos when the run set data.doc_mask).
  knnlm_store=DIR         tokens drawn from kNN-LM's interpolation (models with exit=none).
  encoder-decoder         (model.arch=encoder_decoder) source=<text> or source_file=<path> is encoded once;
                          the decoder runs one cached step per token (its cross-attention keys and values
                          projected once): greedy (temperature=0), sampling, or beam search (beam_size > 1,
                          length_penalty: GNMT's alpha). prompt is not used.
Cannot generate: classifiers and other tasks than causal LM (they predict no next token: use `xfam eval`);
models trained on data without a text tokenizer (synthetic tasks); attention that needs exactly
model.max_len tokens per sequence (fixed_length). check=true recomputes the whole sequence (with memory:
segment by segment) and compares the logits."""

GENERATE = Command(
    "generate",
    "sample text from a language-model checkpoint",
    (
        ckpt(),
        Option("prompt", STR, "", "text to continue", example="'def '"),
        Option("max_new_tokens", INT, 200, "tokens to generate", check=POSITIVE),
        Option("temperature", FLOAT, 0.8, "0 = greedy", check=must("a number >= 0 (0: greedy)", finite(at_least(0)))),
        Option(
            "top_k",
            INT,
            0,
            "keep the k most likely tokens (0 = off)",
            check=must("an integer >= 0 (0: off)", at_least(0)),
        ),
        Option(
            "top_p",
            FLOAT,
            1.0,
            "nucleus sampling mass (1 = off)",
            check=must("a number in (0, 1] (1: off)", finite(lambda v: 0 < v <= 1)),
            example="0.9",
        ),
        Option("source", STR, None, "encoder-decoder: the source text", example="'def f(x): return x'"),
        Option("source_file", PATH, None, "encoder-decoder: a file whose text is the source"),
        Option(
            "beam_size",
            INT,
            1,
            "encoder-decoder: beam search with this many beams (1: greedy or sampling)",
            check=POSITIVE,
        ),
        Option(
            "length_penalty",
            FLOAT,
            1.0,
            "encoder-decoder beam search: GNMT's alpha",
            check=must("a number >= 0", finite(at_least(0))),
        ),
        Option("num_samples", INT, 1, "samples drawn from the prompt", check=POSITIVE),
        Option("seed", INT, 0, "random seed of the sampling"),
        Option("check", BOOL, False, "also verify the logits against a full recompute"),
        Option("knnlm_store", PATH, None, "sample from kNN-LM over this datastore (xfam knnlm build)"),
        Option(
            "knnlm_lambda",
            FLOAT,
            0.25,
            "kNN-LM: weight of p_kNN",
            check=must("a number in [0, 1]", finite(lambda v: 0 <= v <= 1)),
        ),
        Option("knnlm_k", INT, 1024, "kNN-LM: neighbours retrieved per token", check=POSITIVE),
        Option(
            "knnlm_temperature",
            FLOAT,
            1.0,
            "kNN-LM: p_kNN ∝ exp(-d / temperature)",
            check=must("a number > 0", finite(lambda v: v > 0)),
        ),
        Option("knnlm_index", Choice(*knnlm.INDEXES), "exact", "kNN-LM: search index"),
        Option(
            "decoder",
            Choice("auto", "compiled", "static", "eager"),
            "auto",
            "compiled: fixed-shape cache, compiled step; static: not compiled; eager: growing cache",
        ),
        Option(
            "compile_mode",
            Choice("default", "reduce-overhead", "max-autotune"),
            "default",
            "torch.compile mode of the compiled step (max-autotune: on a CPU weights frozen, GEMMs tuned, ~3x faster "
            "per token after ~20 s of compiling; reduce-overhead: CUDA graphs)",
        ),
        DEVICE,
    ),
    run="xfam.cli.sample:sample",
    passthrough=EXIT,
    description=GENERATE_DESCRIPTION,
)

IN_01 = must("a number in (0, 1)", finite(lambda v: 0 < v < 1))
CALIBRATE = Command(
    "calibrate",
    "pick an early-exit threshold on held-out data (LTT or grid search)",
    (
        ckpt("checkpoint file (.ckpt) of an exit=calm / depth_adaptive run"),
        Option("split", SPLITS, "validation", "the held-out split"),
        Option("method", Choice("ltt", "grid"), "ltt", "ltt: CALM's guarantee; grid: Elbayad"),
        Option("delta", FLOAT, 0.1, "ltt: tolerated disagreement with the full model", check=IN_01),
        Option("epsilon", FLOAT, 0.05, "ltt: allowed probability of exceeding delta", check=IN_01),
        Option(
            "tolerance",
            FLOAT,
            0.02,
            "grid: tolerated loss increase over full depth",
            check=must("a number >= 0", finite(at_least(0))),
        ),
        Option(
            "thresholds",
            ListOf(FLOAT),
            [],
            "candidates, e.g. 0.9,0.8,0.7 (default: a grid for the policy)",
            example="0.9,0.8,0.7",
        ),
        batch_size(),
        limit("use at most this many batches"),
        DEVICE,
    ),
    run="xfam.cli.calibrate:calibrate",
    passthrough=EXIT,
)


ROLLOUT = Command(
    "rollout",
    "run a Decision Transformer checkpoint in its environment at target returns",
    (
        ckpt("checkpoint file (.ckpt) of a task=decision run"),
        Option(
            "target_return",
            ListOf(FLOAT),
            [],
            "returns to condition on, e.g. 500,250 (default: the expert behaviour's mean return)",
            example="500,250",
        ),
        Option("episodes", INT, 10, "episodes per target return", check=POSITIVE),
        Option("seed", INT, 0, "episode i is reset with seed seed + i (and sampling seeded with seed)"),
        Option("sample", BOOL, True, "discrete actions drawn from the prediction (false: the most likely)"),
        Option(
            "max_steps",
            INT,
            None,
            "cut episodes after this many steps (default: the environment's limit)",
            check=POSITIVE,
            example="200",
        ),
        Option("out", PATH, None, "also write every episode's return and length to this JSON file"),
        DEVICE,
    ),
    run="xfam.cli.rollout:run",
)


CONVERT = Command(
    "convert",
    "a sharded checkpoint (trainer=fsdp, a folder) to one file, or one file to a sharded folder",
    (
        training_ckpt("checkpoint: a sharded checkpoint's folder, or a .ckpt file"),
        Option("out", PATH, help="where to write the other format", required=True, example="runs/x/last-full.ckpt"),
        Option("overwrite", BOOL, False, "replace an existing out"),
    ),
    run="xfam.cli.convert:run",
)

EXPORT = Command(
    "export",
    "a checkpoint to a model folder without pickle (safetensors, config.json, model card)",
    (
        training_ckpt("training checkpoint: a .ckpt file or a sharded checkpoint's folder"),
        Option("out", PATH, help="the folder to write (new or empty)", required=True, example="exports/my-model"),
        Option("force", BOOL, False, "write into a non-empty out (replaces an export's files, keeps others)"),
    ),
    run="xfam.cli.export:run",
    description="""\
Writes into out: model.safetensors (the weights; shared tensors stored once), config.json (the run's resolved
config, data info, versions, format), tokenizer.json (a BPE or pretrained tokenizer) and README.md (a model card:
components and papers, size, data, metrics, the training command). The folder loads without pickle:
xfam.load_model(out), xfam eval ckpt=out, xfam generate ckpt=out. Upload it yourself, e.g.
huggingface-cli upload <user>/<model> out . (docs/export.md).""",
)


def knn_options(args: Args) -> list[str]:
    """kNN-LM's own check of k, lambda and temperature, before the checkpoint and the datastore are read."""
    from xfam.knnlm.interpolate import check_knn_options

    try:
        check_knn_options(args.k, vars(args)["lambda"], args.temperature)
    except ConfigError as err:
        return err.problems
    return []


KNNLM = Group(
    "knnlm",
    "kNN-LM: build a datastore from a checkpoint, evaluate the interpolation",
    (
        Command(
            "build",
            "keys and next tokens of a split of the checkpoint's data",
            (
                ckpt("checkpoint file (.ckpt) of a language model"),
                Option("split", SPLITS, "train", "the text the datastore memorises"),
                Option("out", PATH, None, "datastore directory (default: <run dir>/knnlm/<ckpt>_<split>)"),
                limit("at most this many batches of the split"),
                batch_size(),
                Option("dtype", Choice("float16", "float32"), "float16", "key storage (the authors' code: fp16)"),
                Option("overwrite", BOOL, False, "replace an existing datastore in out"),
                DEVICE,
            ),
            run="xfam.cli.knnlm:run",
        ),
        Command(
            "eval",
            "the base model and kNN-LM on a split (loss, perplexity, bits per byte)",
            (
                ckpt("checkpoint file (.ckpt) the datastore was built from"),
                Option(
                    "store",
                    PATH,
                    help="datastore directory written by `xfam knnlm build`",
                    required=True,
                    example="runs/<name>/<run>/knnlm/last_train",
                ),
                Option("split", SPLITS, "test", "the store's own split: own entries excluded"),
                Option("k", INT, 1024, "neighbours retrieved (paper: 1024)"),
                Option("lambda", FLOAT, 0.25, "weight of p_kNN (paper, WikiText-103: 0.25)"),
                Option("temperature", FLOAT, 1.0, "p_kNN ∝ exp(-d / temperature) (paper: 1)"),
                Option("index", Choice(*knnlm.INDEXES), "exact", "exact: torch; faiss: IndexFlatL2"),
                batch_size(),
                limit(),
                DEVICE,
            ),
            run="xfam.cli.knnlm:run",
            checks=(knn_options,),
        ),
    ),
    dest="step",
    what="step",
    description=(knnlm.__doc__ or "").replace("``", "`"),
)

DESCRIPTION = """\
    xfam train attention=performer pos=alibi   train (Hydra overrides, -m sweeps, --config-dir DIR)
    xfam list [markdown=true]              every slot, component, parameter and capability
    xfam eval ckpt=PATH [split=test]       metrics of a checkpoint on a split of its data
    xfam generate ckpt=PATH prompt="def "  sampling (KV cache; memory models carry their memory)
    xfam calibrate ckpt=PATH delta=0.1     an early-exit threshold with a guarantee (Learn-then-Test)
    xfam knnlm build ckpt=PATH             a kNN-LM datastore of a split (keys: the final FFN's input)
    xfam knnlm eval ckpt=PATH store=DIR    the checkpoint with and without kNN-LM interpolation
    xfam rollout ckpt=PATH target_return=500,250   a Decision Transformer acting in its environment
    xfam convert ckpt=PATH out=PATH        a sharded checkpoint (a folder) <-> one file
    xfam export ckpt=PATH out=DIR          a model folder without pickle: safetensors, config.json, model card

Options are key=value words, as train.py's overrides (--key=value and --key value work too; a bool
option takes true/false, 1/0 or yes/no, and --key alone means true; key=null sets an option whose
default is null to None). Early-exit models take exit.KEY=VALUE words in eval, generate and calibrate
(e.g. exit.threshold=0.8 exit.measure=saturation): their inference options."""

#: The ``xfam`` command: every subcommand.
XFAM = Group(
    "xfam",
    "train, list components, evaluate, sample from, roll out, convert and export checkpoints",
    (TRAIN, LIST, EVAL, GENERATE, CALIBRATE, KNNLM, ROLLOUT, CONVERT, EXPORT),
    description=DESCRIPTION,
)


def commands(root: Group = XFAM, prefix: str = "") -> dict[str, Command]:
    """Every runnable command by its words after ``xfam`` (``"eval"``, ``"knnlm build"``)."""
    out: dict[str, Command] = {}
    for child in root.commands:
        name = f"{prefix}{child.name}"
        if isinstance(child, Group):
            out |= commands(child, f"{name} ")
        else:
            out[name] = child
    return out
