"""The loop's one TOML file: sections, defaults, and validation that names the key and its line.

A file as a new user writes it (every key optional; ``polar loop --example`` prints this)::

    out = "runs/my-loop"            # run directory; the same command resumes it

    [model]
    name = "qwen2.5-coder-0.5b-instruct"   # a Polar model name or a Hugging Face model directory

    [harness]
    name = "pi-chat"
    timeout_s = 150

    [tasks]
    source = "coding"               # built-in set, Harbor dir/dataset, or JSONL file
    limit = 2

    [rollout]
    samples_per_group = 4
    groups_per_step = 2
    iterations = 1

    [trainer]
    lr = 1e-6

tomllib keeps no line numbers, so :func:`key_line` finds a key's line by scanning the text
(table headers, dotted keys); an error reads ``loop.toml:12: rollout.samples_per_group must be an
integer, got "4" (a string)``.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from polar_training.config import LossConfig, TrainConfig


class ConfigError(ValueError):
    """A configuration file the loop cannot run; the message names the file, line and key."""


# ---------------------------------------------------------------------------------------------
# the sections (each field's comment is its documentation; defaults are the demo's)


@dataclass
class ModelSection:
    name: str = "qwen2.5-coder-0.5b-instruct"  # a Polar model name or a Hugging Face model directory
    max_model_len: int = 16384  # vLLM context length
    kv_cache_gib: float = 1.0
    tool_parser: str = "lenient"  # lenient | hermes | another vLLM parser | none
    gpu: Optional[bool] = None  # absent: a GPU when one is found


@dataclass
class HarnessSection:
    name: str = "pi-chat"  # a preset of `polar harness list`
    command: str = ""  # the generic preset's command template ({base_url}, {api_key}, {task}, ...)
    timeout_s: Optional[float] = None  # per harness run (absent: 150 on CPU, 300 on a GPU)
    concurrency: int = 2  # harness runs at once
    exact_history: bool = True  # proxy option polar_exact_history


@dataclass
class TasksSection:
    source: str = "coding"  # a built-in set, a Harbor task dir or dataset, a JSONL file
    ids: list[str] = field(default_factory=list)  # only these task ids
    limit: int = 2  # the first N tasks (0: all)


@dataclass
class RolloutSection:
    samples_per_group: int = 4  # samples per task: one GRPO group
    groups_per_step: int = 0  # groups (tasks) per training step, cycling through the tasks (0: every task)
    iterations: int = 1  # rollout -> train -> push iterations, then a final rollout
    final_rollout: bool = True  # false: the last step only evaluates (eval.every), no training-task rollout


@dataclass
class SamplingSection:
    temperature: float = 1.0  # plain sampling, enforced by the proxy (polar_sampling)
    seed: Optional[int] = 0  # base of the per-call seeds (-1: unseeded)
    max_tokens: Optional[int] = None  # cap on every answer (absent: 256 on CPU, 1024 on a GPU)


@dataclass
class TrainerSection:
    lr: float = TrainConfig.lr
    kl_coef: Optional[float] = None  # absent: the recipe's, or 0 for a single CPU iteration (see `polar demo`)
    lora_rank: int = 0  # 0: full fine-tuning
    server_during_train: str = "auto"  # keep | stop | auto
    keep_checkpoints: int = 2  # full checkpoints kept (one per step is written: resume needs it)


@dataclass
class EvalSection:
    every: int = 0  # evaluate the served policy every N rollout steps and at the end (0: off)
    samples: int = 4
    tasks: str = ""  # tasks evaluated, as tasks.source takes them ("": the training tasks; another set measures transfer)
    ids: list[str] = field(default_factory=list)  # only these task ids of eval.tasks


@dataclass
class SandboxSection:
    backend: str = "auto"  # auto | bubblewrap | docker | podman | apptainer | host
    pids: int = 4096
    allow_internet: bool = False  # tasks with allow_internet = true get public hosts in the agent phase


@dataclass
class PlacementSection:
    kind: str = "local"  # local (this machine), ray (docs/cluster.md), or "module:attribute" naming a Placement factory
    address: str = ""  # ray: an existing cluster ("auto", "HOST:6379"); empty starts a local one on this machine
    node_dir: str = ""  # ray: each node's own directory (captures, work dirs), absolute; empty: <out>/nodes
    node_resource: str = ""  # ray: only nodes with this custom resource get a node agent; empty: every node
    replicas: list[str] = field(default_factory=list)  # ray: vLLM URLs you run; empty: one vLLM actor per node
    trainer_cpus: int = 1  # ray: the trainer's placement group bundle
    trainer_gpus: int = 0
    max_retries: int = 2  # ray: a group's re-dispatches after node losses before it is dropped


@dataclass
class ScheduleSection:
    #: the versions allowed between the policy being trained and the oldest policy that produced any
    #: token of a trained sample; 0: synchronous (rollouts wait for the push)
    max_off_policy_steps: int = 0
    groups_in_flight: int = 0  # asynchronous mode: groups rolling out at once (0: groups_per_step)


@dataclass
class LoopConfig:
    out: str = "runs/loop"
    notebooks: bool = False  # execute the debugging notebooks on the run at the end
    model: ModelSection = field(default_factory=ModelSection)
    harness: HarnessSection = field(default_factory=HarnessSection)
    tasks: TasksSection = field(default_factory=TasksSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    eval: EvalSection = field(default_factory=EvalSection)
    sandbox: SandboxSection = field(default_factory=SandboxSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def on_gpu(self) -> bool:
        if self.model.gpu is not None:
            return self.model.gpu
        from polar_core import paths

        return paths.has_gpu()

    def resolved_max_tokens(self) -> int:
        return self.sampling.max_tokens or (1024 if self.on_gpu else 256)

    def resolved_timeout(self) -> float:
        return self.harness.timeout_s or (300.0 if self.on_gpu else 150.0)

    def resolved_kl_coef(self) -> float:
        if self.trainer.kl_coef is not None:
            return self.trainer.kl_coef
        return LossConfig.kl_coef if self.rollout.iterations > 1 or self.on_gpu else 0.0


# ---------------------------------------------------------------------------------------------
# lines of keys (tomllib has none)

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^\s*((?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'))*)\s*=")


def _split_key(text: str) -> tuple[str, ...]:
    parts = re.findall(r"\"[^\"]*\"|'[^']*'|[A-Za-z0-9_-]+", text)
    return tuple(p[1:-1] if p[:1] in "\"'" else p for p in parts)


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Every key's and table's line (1-based), by its full dotted path. Lines inside multi-line
    strings and arrays are skipped well enough for error messages (a key's first line counts)."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    in_multiline: str | None = None
    depth = 0  # open brackets of a multi-line array value
    for n, line in enumerate(text.splitlines(), start=1):
        if in_multiline:
            if in_multiline in line:
                in_multiline = None
            continue
        if depth > 0:
            depth += line.count("[") - line.count("]")
            continue
        m = _HEADER.match(line)
        if m and not _KEY.match(line):
            table = _split_key(m.group(1))
            lines.setdefault(table, n)
            continue
        m = _KEY.match(line)
        if not m:
            continue
        path = table + _split_key(m.group(1))
        lines.setdefault(path, n)
        value = line[m.end():]
        for quote in ('"""', "'''"):
            if value.count(quote) == 1:
                in_multiline = quote
        stripped = value.split("#", 1)[0]
        if stripped.strip().startswith("["):
            depth = stripped.count("[") - stripped.count("]")
    return lines


def key_line(text: str, path: tuple[str, ...]) -> int | None:
    """The line of ``path`` or, if it is not written itself, of its nearest written parent."""
    lines = key_lines(text)
    for i in range(len(path), 0, -1):
        if path[:i] in lines:
            return lines[path[:i]]
    return None


# ---------------------------------------------------------------------------------------------
# validation

_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _describe(value: Any) -> str:
    kind = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)
    shown = repr(value) if not isinstance(value, str) else '"' + value + '"'
    if isinstance(value, dict):
        shown = "{...}"
    return f"{shown} ({kind})"


def _coerce(value: Any, tp: Any) -> tuple[bool, Any, str]:
    """(ok, value, expected) for a TOML value against a field's annotation."""
    origin = get_origin(tp)
    if origin is Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        return _coerce(value, args[0])
    if origin is list:
        (item,) = get_args(tp)
        if not isinstance(value, list):
            return False, value, f"an array of {_TYPE_WORDS[item].split(' ', 1)[1]}s"
        out = []
        for v in value:
            ok, v2, _ = _coerce(v, item)
            if not ok:
                return False, value, f"an array of {_TYPE_WORDS[item].split(' ', 1)[1]}s"
            out.append(v2)
        return True, out, ""
    if tp is bool:
        return isinstance(value, bool), value, "true or false"
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value, "an integer"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value, "a number"
    if tp is str:
        return isinstance(value, str), value, "a string"
    raise TypeError(f"unsupported field type {tp}")  # pragma: no cover - a bug in this module


def _build(cls: type, data: dict[str, Any], where: tuple[str, ...], err: Any) -> Any:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = where + (key,)
        if key not in fields:
            known = ", ".join(sorted(fields))
            err(path, f"unknown key {'.'.join(path)!r} (known in {'.'.join(where) or 'the top level'}: {known})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                err(path, f"{'.'.join(path)} must be a table ([{'.'.join(path)}]), got {_describe(value)}")
            kwargs[key] = _build(tp, value, path, err)
            continue
        ok, coerced, expected = _coerce(value, tp)
        if not ok:
            err(path, f"{'.'.join(path)} must be {expected}, got {_describe(value)}")
        kwargs[key] = coerced
    return cls(**kwargs)


_CHOICES = {
    ("trainer", "server_during_train"): ("auto", "keep", "stop"),
}
_MINIMA = {
    ("rollout", "samples_per_group"): 1, ("rollout", "groups_per_step"): 0, ("rollout", "iterations"): 0,
    ("harness", "concurrency"): 1, ("tasks", "limit"): 0, ("trainer", "lora_rank"): 0,
    ("trainer", "keep_checkpoints"): 1, ("eval", "every"): 0, ("eval", "samples"): 1,
    ("schedule", "max_off_policy_steps"): 0, ("schedule", "groups_in_flight"): 0, ("model", "max_model_len"): 256, ("sandbox", "pids"): 1,
    ("placement", "trainer_cpus"): 1, ("placement", "trainer_gpus"): 0, ("placement", "max_retries"): 0,
}


def _check_values(cfg: LoopConfig, err: Any) -> None:
    for (sec, key), choices in _CHOICES.items():
        v = getattr(getattr(cfg, sec), key)
        if v not in choices:
            err((sec, key), f"{sec}.{key} must be one of {', '.join(choices)}, got {_describe(v)}")
    for (sec, key), lo in _MINIMA.items():
        v = getattr(getattr(cfg, sec), key)
        if v < lo:
            err((sec, key), f"{sec}.{key} must be >= {lo}, got {v}")
    if cfg.sampling.temperature <= 0:
        err(("sampling", "temperature"), "sampling.temperature must be > 0 (greedy calls cannot be trained on)")
    if cfg.trainer.lr <= 0:
        err(("trainer", "lr"), f"trainer.lr must be > 0, got {cfg.trainer.lr}")
    if cfg.sampling.max_tokens is not None and cfg.sampling.max_tokens < 1:
        err(("sampling", "max_tokens"), "sampling.max_tokens must be >= 1")
    if cfg.schedule.max_off_policy_steps > 0 and cfg.trainer.server_during_train == "stop":
        err(("trainer", "server_during_train"), "trainer.server_during_train = \"stop\" stops rollouts while training: "
            "asynchronous rollouts (schedule.max_off_policy_steps > 0) need \"keep\" or \"auto\"")
    if not cfg.rollout.final_rollout and not cfg.eval.every:
        err(("rollout", "final_rollout"), "rollout.final_rollout = false leaves the last step only its evaluation: "
            "set eval.every too, or the policy after the last update is never measured")
    if cfg.eval.ids and not cfg.eval.tasks:
        err(("eval", "ids"), "eval.ids selects tasks of eval.tasks: set eval.tasks too (the training tasks are tasks.ids)")
    if cfg.placement.kind not in ("local", "ray") and ":" not in cfg.placement.kind:
        err(("placement", "kind"), "placement.kind must be \"local\", \"ray\" or \"module:attribute\", got "
            f"{_describe(cfg.placement.kind)}")
    if cfg.placement.node_dir and not cfg.placement.node_dir.startswith("/"):
        err(("placement", "node_dir"), "placement.node_dir must be absolute (every node resolves it alone), got "
            f"{_describe(cfg.placement.node_dir)}")
    if cfg.harness.name == "generic" and not cfg.harness.command:
        err(("harness", "command"), "harness.name = \"generic\" needs harness.command (a shell command template)")


def parse_config(text: str, source: str = "<config>") -> LoopConfig:
    """A :class:`LoopConfig` from TOML text; :class:`ConfigError` names ``source:line`` and the key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None

    def err(path: tuple[str, ...], message: str) -> None:
        line = key_line(text, path)
        raise ConfigError(f"{source}:{line}: {message}" if line else f"{source}: {message}")

    cfg = _build(LoopConfig, data, (), err)
    _check_values(cfg, err)
    return cfg


def load_config(path: str | Path) -> LoopConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc.strerror or exc}") from None
    return parse_config(text, str(p))


def example_toml() -> str:
    """Every key with its default, commented: what ``polar loop --example`` prints."""
    return to_toml(LoopConfig())


def to_toml(cfg: LoopConfig) -> str:
    """Every key of ``cfg``, commented, as a file :func:`parse_config` reads back to an equal
    configuration (``polar demo --print-config`` prints its built-in one this way)."""
    import inspect
    import json

    src = inspect.getsource(__import__(__name__, fromlist=["x"]))
    comments: dict[tuple[str, str], str] = {}
    cls_name = None
    for line in src.splitlines():
        m = re.match(r"^class (\w+)Section", line)
        if m:
            cls_name = m.group(1).lower()
        m = re.match(r"^    (\w+): [^=]+=[^#]*#\s*(.*)$", line)
        if m and cls_name:
            comments[(cls_name, m.group(1))] = m.group(2)

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)  # a TOML basic string: quotes and backslashes escaped
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    out = [f'out = {fmt(cfg.out)}  # run directory; the same command resumes it',
           f"notebooks = {fmt(cfg.notebooks)}"]
    for f in dataclasses.fields(cfg):
        sec = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(sec):
            continue
        out.append(f"\n[{f.name}]")
        for sf in dataclasses.fields(sec):
            v = getattr(sec, sf.name)
            note = comments.get((f.name, sf.name), "")
            line = f"{sf.name} = {fmt(v)}" if v is not None else f"# {sf.name} = (absent)"
            out.append(line + (f"  # {note}" if note else ""))
    return "\n".join(out) + "\n"
