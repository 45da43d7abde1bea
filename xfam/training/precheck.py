"""The pre-launch check of a command line: every job it would launch, composed and validated before Hydra.

``precheck(argv)`` runs before Hydra: it composes every job a command line would launch (each
combination of a sweep, up to a limit) and validates each with xfam, so an unknown option, an
unknown key or an incompatible combination is reported in one clear message before any job
starts or any directory is created; so is a trainer this machine cannot run (``trainer=fsdp``
without a GPU), unless the jobs go to a cluster (``hydra/launcher=...``). It reads Hydra's flags as
Hydra does (``-m``, ``--config-dir DIR``, ``-cn NAME``) and composes with the same config search path
(a user's own config folder included); an override Hydra cannot parse is named with the grammar. In a
sweep, jobs that are individually invalid (e.g. one attention x pos pair that cannot combine, or a key
only some jobs' components have) do not stop the others: they are announced, then recorded as
skipped with their reason (``force_keys`` composes them as the sweep launches them,
``xfam.training.hydra_callbacks``).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from xfam.core.errors import ConfigError, did_you_mean, unknown_choice
from xfam.training.plugin_options import prepare as prepare_plugins
from xfam.training.run_names import CONFIG_DIR, register_resolvers

MAX_PRECHECK_JOBS = 256


def config_groups(dirs: list[Path] | None = None) -> dict[str, list[str]]:
    """Config groups and their options: configs/'s, or those of every folder of ``dirs`` (a config
    search path: the primary config folder, then a ``--config-dir``), merged."""
    groups: dict[str, set[str]] = {}
    for root in dirs or [CONFIG_DIR]:
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            if d.is_dir() and d.name != "hydra" and (options := {p.stem for p in d.glob("*.yaml")}):
                groups.setdefault(d.name, set()).update(options)
    return {group: sorted(options) for group, options in sorted(groups.items())}


def _job_overrides(args: list[str]) -> list[list[str]] | None:
    """Every job's override list (sweeps expanded); None when a sweep cannot be enumerated."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=args)
    choices = []
    for ov in parsed:
        if ov.key_or_group.startswith("hydra"):
            continue
        if ov.is_sweep_override():
            if ov.is_interval_sweep():
                return None
            values = list(ov.sweep_string_iterator())
            choices.append([f"{ov.get_key_element()}={v}" for v in values])
        else:
            choices.append([str(ov.input_line)])
    jobs = [list(c) for c in itertools.islice(itertools.product(*choices), MAX_PRECHECK_JOBS + 1)]
    return jobs[:MAX_PRECHECK_JOBS]


#: Hydra's override grammar, for the fix of an override it cannot parse.
GRAMMAR = (
    "an override is key=value (model.dim=64), group=option (pos=alibi), +key=value (a new key), ++key=value "
    "(add or set) or ~key (remove); quote one with spaces, brackets or braces for the shell ('data.paths=[a, b]', "
    "'+attention.per_layer={-1: {dropout: 0.1}}'); Hydra's flags (-m, --config-dir DIR): python train.py --hydra-help"
)


def hydra_args(args: list[str]) -> Any:
    """``args`` parsed as Hydra parses them (its flags: ``-m``, ``--config-dir DIR``, ``-cn NAME``, ...;
    ``.overrides``: the rest); raises ConfigError where Hydra would stop with its usage."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def error(message: str) -> None:
        where = "; put them before or after the overrides, not between" if "unrecognized" in message else ""
        raise ConfigError(
            f"{message}. Fix: python train.py --hydra-help lists Hydra's flags (-m, --config-dir DIR, "
            f"--config-name NAME, --cfg job, ...){where}; everything else is an override, key=value."
        )

    parser.error = error  # type: ignore[method-assign,assignment]  # (argparse would print the usage and exit)
    return parser.parse_args(args)


def _search_path(flags: Any) -> tuple[Any, list[Path]]:
    """The config search path Hydra's main() builds for these flags (``--config-path``, ``--config-dir``)
    and its folders, primary first."""
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    config_path = flags.config_path if flags.config_path is not None else "configs"  # train.py's
    prepare_plugins(flags.overrides)  # (their generated options join every search path Hydra builds)
    search_path = create_automatic_config_search_path(str(CONFIG_DIR.parent / "train.py"), None, config_path)
    if flags.config_dir is not None:
        extra = os.path.abspath(flags.config_dir)
        if not os.path.isdir(extra):
            raise ConfigError(
                f"--config-dir {flags.config_dir}: no such folder ({extra}). Fix: give the folder that holds your "
                f"config groups (e.g. my_configs with my_configs/experiment/mine.yaml), relative to this directory."
            )
        search_path.prepend(provider="command-line", path=f"file://{extra}", anchor=SearchPathQuery(provider="schema"))
    dirs = [
        Path(e.path.removeprefix("file://"))
        for e in search_path.get_path()
        if e.provider in ("main", "command-line", "xfam-plugins") and not e.path.startswith("pkg://")
    ]
    if not dirs or not dirs[0].is_dir():
        raise ConfigError(
            f"--config-path {flags.config_path}: no such folder ({dirs[0] if dirs else flags.config_path}; a "
            f"relative path is relative to train.py's folder). Fix: give an existing folder, or add your "
            f"configs to the repository's with --config-dir DIR."
        )
    return search_path, dirs


def _shadowed(dirs: list[Path]) -> list[str]:
    """Files of a ``--config-dir`` that Hydra never reads: the primary folder's file of that name wins."""
    return [
        f"{extra / rel}: configs of this name are read from {dirs[0] / rel}, so yours is never used. "
        f"Fix: rename yours (e.g. {rel.parent / ('my_' + rel.name)}) and select it by that name."
        for extra in dirs[1:]
        for rel in sorted(p.relative_to(extra) for p in extra.glob("*/*.yaml"))
        if (dirs[0] / rel).is_file()
    ]


def _syntax_problems(overrides: list[str]) -> list[str]:
    """One problem per override Hydra's grammar cannot parse: the override, Hydra's reason, the fix."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser, problems = OverridesParser.create(), []
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException as err:
            lines = str(err).splitlines()
            why = " ".join(s for s in lines if not s.startswith(("See https://", "Error parsing override")))
            why = " ".join(why.replace("^", "").split())  # (Hydra's lexer errors point with ^)
            fixed = _unquoted_keys(override)
            fix = f"Hydra reads dict keys without quotes: write {shlex.quote(fixed)}" if fixed else GRAMMAR
            problems.append(f"override {override!r}: Hydra cannot parse it ({why}). Fix: {fix}.")
    return problems


def _unquoted_keys(override: str) -> str | None:
    """``override`` with its quoted dict keys unquoted (``{"-1": ...}`` as YAML writes it, ``{-1: ...}`` as
    Hydra's grammar does), a ``per_layer`` key added with ``+`` (the slot YAMLs do not hold it); None
    when that does not parse either."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    fixed = re.sub(r"""([{,]\s*)(["'])([^"',:{}\[\]]*)\2(\s*:)""", r"\1\3\4", override)
    key = fixed.split("=", 1)[0]
    if key.split(".")[-1] == "per_layer" and not key.startswith(("+", "~")):
        fixed = "+" + fixed
    try:
        OverridesParser.create().parse_overrides([fixed])
    except OverrideParseException:
        return None
    return fixed if fixed.lstrip("+") != override.lstrip("+") else None


def _group_problems(args: list[str], groups: dict[str, list[str]] | None = None) -> tuple[list[str], list[str]]:
    """Unknown config-group options (of ``groups``: configs/'s by default), and the overrides that remain
    once those are dropped."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = groups if groups is not None else config_groups()
    problems: list[str] = []
    kept: list[str] = []
    for ov in OverridesParser.create().parse_overrides(overrides=args):
        group = ov.key_or_group.lstrip("+~")
        values: list[Any] = []
        if group in groups and not ov.is_interval_sweep():
            values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.value()]
        bad = [v for v in values if isinstance(v, str) and v not in groups[group] and v != "null"]
        for v in bad:
            problems.append(unknown_choice(group, v, groups[group], f"pass {group}=<one of the valid choices>."))
        if not bad:
            kept.append(str(ov.input_line))
    return problems, kept


def _unknown_key(err: Exception) -> str | None:
    """The dotted key of Hydra's "Could not override 'a.b'" error, if that is what ``err`` is."""
    msg = str(err)
    if msg.startswith("Could not override '"):
        return msg.split("'")[1]
    return None


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=")[0]


def force_keys(job: list[str], keys: list[str] | set[str]) -> list[str]:
    """``job`` with its plain overrides of ``keys`` written ``++key=value`` (set even where the config
    has no such key). A sweep launches a job whose component lacks a key another job's has (``-m
    pos=rope,alibi pos.rotary_dim=8``) so: its run then refuses the key and it is recorded as skipped."""
    return ["++" + o if _override_key(o) in keys and not o.startswith(("+", "~")) else o for o in job]


def _key_problem(key: str, base: dict[str, Any]) -> str:
    section, _, leaf = key.rpartition(".")
    node: Any = base
    for part in section.split(".") if section else []:
        node = node.get(part, {}) if isinstance(node, dict) else {}
    valid = sorted(node) if isinstance(node, dict) else []
    hint = did_you_mean(leaf, valid)
    where = section or "config"
    # Only the schedules are keys a YAML leaves out and a command line adds (xfam.core.schedule); every other key
    # is in its section's YAML, and validation refuses any other added one.
    added = leaf in ("per_layer", "per_head")
    fix = f"+{key}=... (a schedule is added with +)" if added else "use one of the valid keys"
    return f"{where}: unknown key {leaf!r}.{hint} Valid keys: {', '.join(valid)}. Fix: {fix}."


def _compose_problem(err: Exception) -> str:
    """Hydra's composition error as one problem; a config file that is not YAML by its name and line."""
    import yaml

    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, yaml.YAMLError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, yaml.MarkedYAMLError) and cause.problem_mark is not None:
        mark, text = cause.problem_mark, " ".join(str(cause).split())
        tabs = " (YAML indents with spaces: replace the tabs)" if "'\\t'" in text else ""
        return f"{mark.name}, line {mark.line + 1}: not valid YAML: {text}. Fix: correct that file{tabs}."
    text = str(cause if cause is not None else err).strip()
    fix = "check the override against `python train.py --help`."
    if text.startswith("Cannot find primary config"):
        fix = "--config-name NAME selects NAME.yaml of the primary config folder (train, the default)."
    return f"{text}\nFix: {fix}" if "\n" in text else f"{text}. Fix: {fix}"


def _package_problems(cfg: Any, groups: dict[str, list[str]]) -> list[str]:
    """A config group's keys at the top of ``cfg``: a selected file (an experiment) that lacks its
    ``# @package _global_`` line, so its keys land under the group's name."""
    from xfam.config import SECTIONS

    return [
        f"{group}: the selected file's keys are under '{group}.' (the file lacks the line '# @package _global_'),"
        f" so they change nothing. Fix: make '# @package _global_' that file's first line (see "
        f"configs/experiment/listops.yaml)."
        for group in groups
        if group in cfg and group not in SECTIONS
    ]


def _compose(compose: Any, config_name: str, job: list[str]) -> tuple[Any, dict[str, str], list[str]]:
    """Compose ``job``, dropping overrides of keys that do not exist: the config, the problem of each such
    key (the valid keys named are those of the config the rest of the job selects, e.g.
    ``attention=local``'s), and Hydra's other composition errors (then no config)."""
    unknown: list[str] = []
    for _ in range(len(job) + 1):
        try:
            cfg = compose(config_name, overrides=job)
        except Exception as err:  # Hydra's composition errors
            key = _unknown_key(err)
            if key is None or not any(_override_key(o) == key for o in job):
                return None, {}, [_compose_problem(err)]
            unknown.append(key)
            job = [o for o in job if _override_key(o) != key]
            continue
        plain = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=False))
        return cfg, {key: _key_problem(key, plain) for key in unknown}, []
    return None, {}, []


def precheck(args: list[str]) -> None:
    """Validate every job of a command line (``args``: Hydra's flags and the overrides); raises
    ConfigError. In a sweep of several jobs, jobs invalid on their own (also a key only some jobs'
    components have) are only announced (they will be skipped) unless all are. Writes nothing."""
    from hydra import compose, version
    from hydra._internal.hydra import Hydra
    from hydra.core.global_hydra import GlobalHydra

    from xfam.config import check_machine, validate

    flags = hydra_args(args)
    search_path, dirs = _search_path(flags)
    config_name = flags.config_name or "train"
    problems = _syntax_problems(flags.overrides)
    if problems:  # nothing else can be read from these
        raise ConfigError(problems)
    groups = config_groups(dirs)
    problems, overrides = _group_problems(flags.overrides, groups)
    problems = _shadowed(dirs) + problems
    launcher = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("hydra/launcher=")]
    here = launcher in ([], ["basic"])  # jobs run on this machine (not on a cluster's nodes)
    job_problems: list[str] = []  # problems of single jobs of a sweep
    jobs = _job_overrides(overrides)
    if jobs is None:  # a sweeper's search space (intervals): check the base config only
        jobs = [[o for o in overrides if "(" not in o]]
    bad_jobs: set[tuple[str, ...]] = set()
    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        version.setbase("1.3")
        Hydra.create_main_hydra2(task_name="train", config_search_path=search_path)  # as train.py's main()
        composed = [_compose(compose, config_name, job) for job in jobs]
        everywhere = set.intersection(*(set(unknown) for _, unknown, _ in composed))  # refused in every job
        refused: dict[str, dict[str, list[str]]] = {}  # key unknown in every job: its problem -> jobs' labels
        for job, (cfg, unknown, errors) in zip(jobs, composed):
            label = f"[{' '.join(job)}] " if len(jobs) > 1 else ""
            problems += errors
            for key in everywhere:
                refused.setdefault(key, {}).setdefault(unknown[key], []).append(label)
            if cfg is None:
                continue
            if some := set(unknown) - everywhere:  # composed as the sweep launches it (see force_keys)
                try:
                    kept = [o for o in job if _override_key(o) not in everywhere]
                    cfg = compose(config_name, overrides=force_keys(kept, some))
                except Exception as err:
                    job_problems.append(label + _compose_problem(err))
                    bad_jobs.add(tuple(job))
                    continue
            try:
                plain = resolved(cfg)
                if stray := _package_problems(plain, groups):
                    raise ConfigError(stray)
                validate(plain)
                if here:
                    check_machine(plain)
            except ConfigError as err:
                (job_problems if len(jobs) > 1 else problems).extend(label + p for p in err.problems)
                bad_jobs.add(tuple(job))
        if not here:  # (the jobs' overrides leave Hydra's own out: the launcher's are needed here)
            own = [o for o in overrides if o.lstrip("+~").startswith("hydra")]
            problems += _launcher_problems(compose, config_name, [j + own for j in jobs if tuple(j) not in bad_jobs])
    finally:
        GlobalHydra.instance().clear()
    for texts in refused.values():  # once, or per job where the jobs' valid keys differ
        problems += [(label if len(texts) > 1 else "") + t for t, labels in texts.items() for label in labels[:1]]
    if problems or (job_problems and len(bad_jobs) == len(jobs)):
        raise ConfigError(list(dict.fromkeys(problems + job_problems)))
    if job_problems:  # (before Hydra configures logging: printed)
        listed = "\n  ".join(dict.fromkeys(job_problems))
        print(
            f"xfam: {len(bad_jobs)} of {len(jobs)} jobs of this sweep cannot run and will be recorded as skipped:"
            f"\n  {listed}",
            file=sys.stderr,
        )


def _launcher_problems(compose: Any, config_name: str, jobs: list[list[str]]) -> list[str]:
    """A cluster launcher (``hydra/launcher=slurm``) allocates the nodes and the tasks per node that every task's
    Lightning then checks against ``trainer.num_nodes`` and ``trainer.devices`` (on the nodes, after the queue):
    they must agree before submission. The launcher's settings are resolved once for the whole sweep, so a sweep
    over ``trainer.num_nodes`` cannot be allocated."""
    problems, nodes_of_jobs = [], set()
    for job in jobs:
        try:
            cfg = compose(config_name, overrides=job, return_hydra_config=True)
            launcher, trainer = (
                cast(dict[str, Any], OmegaConf.to_container(cfg.hydra.launcher, resolve=True)),
                cfg.trainer,
            )
        except Exception:  # (composition problems are reported by precheck itself)
            continue
        if str(launcher.get("_target_", "")).endswith("SlurmLauncher") and shutil.which("srun") is None:
            problems.append(  # (submitit's own check says only 'Could not detect "srun"', in a traceback)
                "hydra/launcher=slurm submits the jobs to SLURM, and this machine has no SLURM client (no srun on "
                "PATH). Fix: run the command on the cluster's login node, or drop hydra/launcher=slurm to run the "
                "jobs on this machine."
            )
        num_nodes, devices = trainer.get("num_nodes", 1), trainer.get("devices", 1)
        nodes_of_jobs.add(num_nodes)
        if (nodes := launcher.get("nodes")) is not None and nodes != num_nodes:
            problems.append(
                f"hydra.launcher.nodes={nodes} but trainer.num_nodes={num_nodes}: Lightning refuses a job whose "
                f"nodes differ from trainer.num_nodes (on the nodes, after the queue). Fix: trainer.num_nodes={nodes} "
                f"(hydra.launcher.nodes follows it)."
            )
        tasks = launcher.get("tasks_per_node")
        if isinstance(devices, int) and not isinstance(devices, bool) and tasks is not None and devices != tasks:
            problems.append(
                f"hydra.launcher.tasks_per_node={tasks} but trainer.devices={devices}: one task per device. Fix: "
                f"trainer.devices=auto (the GPUs a task sees), or hydra.launcher.gpus_per_node={devices}."
            )
    if len(nodes_of_jobs) > 1:
        problems.append(
            f"a sweep over trainer.num_nodes ({sorted(nodes_of_jobs)}) under a cluster launcher: its allocation is "
            f"resolved once for the whole sweep. Fix: one sweep per number of nodes."
        )
    return list(dict.fromkeys(problems))


def resolved(cfg: DictConfig) -> dict[str, Any]:
    """``cfg`` as a plain dict with every interpolation resolved; one that cannot be (``model.dim=${oops}``,
    a resolver's error) is a ConfigError naming the key."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "a value"
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"{key}: its interpolation cannot be resolved ({why}). Fix: refer to a key that exists (e.g. "
            f"${{model.dim}}), or quote a value meant literally (key='\\${{...}}')."
        ) from None
