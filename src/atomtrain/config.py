"""The run configuration: it only combines each component's own config.

Values come from defaults, then a TOML file (`--config run.toml`), then command-line overrides
(`--train.lr=1e-3`). Every value is checked against its field's type (floats must be finite), and
`checks.resolve_and_validate` checks every field's range before anything is created or deleted; a
bad one raises AtomError naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atomtrain.errors import AtomError
from atomtrain.optim import AdamWConfig
from atomtrain.train.config import TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class RunSection:
    """Where a run writes and what it runs on."""

    name: str = ""
    """Run name; its files go to `<out_dir>/<name>/` (default: the model preset and a timestamp)."""
    out_dir: str = "runs"
    """Parent directory of run directories."""
    device: str = "auto"
    """`auto` (CUDA when present), `cpu` or `cuda`."""


@dataclass(frozen=True)
class ModelSection:
    """Which model: a named preset, optionally reshaped, or a transformers causal LM."""

    preset: str = "small"
    """One of atomtrain.models.PRESETS (unused with `hf` or `hf_config`)."""
    hf: str = ""
    """A local transformers model directory (config.json, safetensors weights, optionally a
    tokenizer) to fine-tune; needs `pip install atomtrain[hf]`."""
    hf_config: str = ""
    """A transformers config for a model with fresh weights: a JSON file, inline JSON with a
    `model_type`, or a bare model_type such as `llama`."""
    n_layer: int = 0
    """Blocks (0: the preset's)."""
    n_embd: int = 0
    """Width (0: the preset's)."""
    n_head: int = 0
    """Heads (0: the preset's)."""
    dropout: float = 0.0
    """Dropout probability."""


@dataclass(frozen=True)
class DataSection:
    """Where tokens come from and how they are batched."""

    source: str = "stdlib"
    """A text file, directory, glob, or `stdlib` (the Python standard library's source)."""
    prepared: str = ""
    """A directory made by `atomtrain data prepare` (default: a cache keyed by source)."""
    tokenizer: str = "auto"
    """When the data is prepared on the fly: `byte`, `bpe`, a directory with a tokenizer.json,
    or `auto` (the `model.hf` directory's tokenizer when it has one, else `byte`)."""
    rows: int = 16
    """Sequences per optimizer step."""
    seq_len: int = 128
    """Tokens per sequence; when not set, 128 or the model's context if that is shorter."""
    seed: int = 0
    """Seed of the window draw."""
    input: str = "shards"
    """`shards` (prepared, random windows) or `stream` (raw text tokenized on the fly)."""
    input_rate: float = 0.0
    """Streaming only: most tokens per second the input delivers (0: unlimited)."""
    reuse: str = "auto"
    """Data echoing when streamed input is late: auto (on for streams) or off."""
    max_echo: int = 4
    """Most uses of one fresh batch when reusing."""


@dataclass(frozen=True)
class EngineSection:
    """The swap engine: off unless a device memory budget is given."""

    device_memory: str = ""
    """Device bytes training may use, e.g. `24GB` or `512MiB` (empty: the plain trainer)."""
    param_dtype: str = "float32"
    """Dtype of device copies: float32, bfloat16 or float16 (masters stay float32)."""
    precision: str = "fp32"
    """Compute precision: fp32, bf16 or fp16 (autocast; fp32 masters; fp16 with dynamic loss
    scaling)."""
    blocks: str = ""
    """Dotted path of the block container (empty: found automatically)."""
    submodels: int = 0
    """Force this many equal sub-models (0: the planner chooses cut points and policies)."""
    policy: str = "recompute"
    """Activation policy when `submodels` is forced: keep, offload or recompute."""
    max_blocks_per_submodel: int = 8
    """Longest sub-model the planner considers."""
    compile: bool = False
    """Compile each distinct block once with `torch.compile` and run every block of its kind
    through it (swap engine and plain runner alike); the profiler then times compiled blocks."""
    compile_backend: str = "inductor"
    """`torch.compile` backend when compiling: inductor, or aot_eager (no code generation)."""


@dataclass(frozen=True)
class PeerSection:
    """Decentralized training: on when `swarm` is set."""

    swarm: str = ""
    """Swarm name: peers with the same name average together (empty: train alone)."""
    join: str = ""
    """Comma-separated multiaddrs of live peers to join (empty: start a new swarm)."""
    host: str = "127.0.0.1"
    """Address this peer listens on."""
    port: int = 0
    """Port this peer listens on (0: any free port)."""
    identity: str = ""
    """File with this peer's libp2p private key, made when missing (empty: a new identity each
    start). With a fixed port it fixes this peer's address, so others can be started with
    --join at the same time as this one."""
    join_timeout_s: float = 60.0
    """Longest a joiner keeps trying to reach the peers at --join (they may still be starting)."""
    index: int = -1
    """This peer's index, for its data and its name (-1: drawn from the peer's own identity, so
    any number of machines started alike each read their own batches)."""
    num_peers: int = 1
    """With an index: peers the data is split between (each reads its own slice)."""
    sync_every: str = "auto"
    """Local steps between averaging rounds (H), or `auto`: from the measured step and round
    times, so a round finishes within the compute of the next interval."""
    min_sync_every: int = 5
    """Fewest local steps between rounds when `sync_every` is auto."""
    max_sync_every: int = 500
    """Most local steps between rounds when `sync_every` is auto."""
    sync_mode: str = "async"
    """`async`: rounds run while training goes on; `blocking`: synchronous DiLoCo, training
    waits for each round (a baseline)."""
    outer_lr: float = 0.7
    """Learning rate of the outer Nesterov step (DiLoCo's default)."""
    outer_momentum: float = 0.9
    """Momentum of the outer Nesterov step."""
    compression: str = "float16"
    """Wire format of the averaged pseudo-gradient: float16, int8 or int4 (what rounding loses
    goes with the next round: error feedback), or none."""
    matchmaking_s: float = 3.0
    """Time a round waits to gather a group."""
    train_nice: int = 0
    """Niceness the training thread adds to its own once it trains (Linux): with more, while a
    round runs, the peer's helpers (the averager, the p2p daemon) get the CPU first when they
    compete with training for it (between rounds they sleep and training has the CPU alone).
    Measured in 0.45-core quotas (2 peers, 10 Mbit/s, int8), 5 did not make rounds land sooner
    (median 1.08 s against 1.05 s without), so it is off by default."""
    averaging_timeout_s: float = 30.0
    """Longest a round may take before it counts as failed (its progress goes with the next)."""
    start_timeout_s: float = 1.0
    """How long after a member's all-reduce starts each other member must have opened its stream
    of parts to it (besides 1.5 times the start lag that member declares: its longest recent step
    where rounds write their contribution at their slot) before the round ends as lost (peer/
    exact.py); also how long, besides three times its slowest first part (or gap between parts)
    of its latest rounds (for a member with none measured, the lower median of the others'
    slowest), a member that opened its stream may take to send its first part once this member
    let the stream in, and a member that reduces a span its next part. On one machine every
    member's first part came within 0.65 s; raise it on links with long round trips, where
    opening a stream takes several."""
    state_timeout_s: float = 60.0
    """Longest a joiner waits for one download of the swarm's state (slow links need more)."""
    target_group_size: int = 64
    """Largest group a round forms. Every present peer should fit: peers in different groups
    apply different averages and fall out of sync (a butterfly all-reduce sends each member's
    vector about twice whatever the group's size, so large groups cost no more bandwidth)."""
    final_sync: bool = True
    """Wait for one last round at the end, so that finishing peers agree."""
    final_wait_s: float = 120.0
    """Longest a finished peer waits for the others still training before that last round."""
    wait_for: int = 0
    """Before the first step, wait (up to a minute) until this many peers are in the swarm."""
    swarm_key: str = ""
    """File with the swarm key, the owner's (`atomtrain keygen`); empty: $ATOM_SWARM_KEY, else an
    open swarm (or `swarm_cert`)."""
    swarm_cert: str = ""
    """File with this member's certificate (`atomtrain admit`), issued for `identity`: a member
    the owner admitted takes part without the owner's key."""
    defend: bool = True
    """Check every contribution and downloaded state; aggregate robustly (peer/robust.py)."""
    audit: bool = True
    """With `defend`: a second member recomputes each span of every round (peer/audit.py), so a
    reducer that lies is caught; each reducer forwards the parts it combined, about 1.7x the
    bytes of a round with 4 members."""
    follow_ratio: float = 0.3
    """With `defend`: leave out for a while a member whose update follows this peer's little: in
    the medians of its last 3 rounds' readings, a cosine below 0.1 and below this share of the
    closest other member's (a member training on poisoned data). At most 0.5; 0 turns it off: do
    so where honest peers train on very different data (peer/exclusion.py, FOLLOW_RATIO)."""
    lean: float = 0.25
    """With `defend`: leave out for a while a member whose update, less its component along this
    peer's, leans one way by this much in a round's reading (its sum over its absolute sum, and
    that less the same of this peer's update against the member's, halved: the lesser where
    both lean the same way, else none; "a little is enough" moves every coordinate the same way,
    honest updates differ by noise; not read in a pair). At
    least 0.1, at most 1; 0 turns it off (peer/exclusion.py, LEAN)."""
    attack: str = ""
    """Attack benchmark only: poison this peer's contributions (nan, scale, noise, stale,
    push: a directed push with inflated token counts)."""

    def __post_init__(self) -> None:
        if self.sync_every != "auto":
            try:
                steps = int(self.sync_every)
            except ValueError:
                steps = 0
            if steps < 1:
                raise AtomError(
                    f"peer.sync_every must be auto or a positive integer, got {self.sync_every!r}"
                )
        if not 0 <= self.train_nice <= 19:
            raise AtomError(f"peer.train_nice must be 0..19, got {self.train_nice}")
        if not 1 <= self.min_sync_every <= self.max_sync_every:
            raise AtomError("peer.min_sync_every must be at least 1 and at most max_sync_every")
        if self.sync_mode not in ("async", "blocking"):
            raise AtomError(f"peer.sync_mode must be async or blocking, got {self.sync_mode!r}")
        if self.compression not in ("float16", "int8", "int4", "none"):
            raise AtomError(
                f"peer.compression must be float16, int8, int4 or none, got {self.compression!r}"
            )
        if (
            self.index < -1
            or self.num_peers < 1
            or (self.index >= 0 and self.index >= self.num_peers)
        ):
            raise AtomError(
                f"peer.index ({self.index}) must be -1 (auto) or below peer.num_peers "
                f"({self.num_peers})"
            )
        if not (self.start_timeout_s > 0 and math.isfinite(self.start_timeout_s)):
            raise AtomError(
                f"peer.start_timeout_s must be a positive number, got {self.start_timeout_s}"
            )
        if self.target_group_size < 2:
            raise AtomError("peer.target_group_size must be at least 2")

    @property
    def fixed_sync_every(self) -> int:
        """H when set by hand, 0 when auto."""
        return 0 if self.sync_every == "auto" else int(self.sync_every)


@dataclass(frozen=True)
class LogSection:
    """What a run writes besides metrics.jsonl."""

    tensorboard: bool = False
    """Also write TensorBoard event files to `<run dir>/tensorboard/` (needs the `tensorboard`
    package: pip install 'atomtrain[tensorboard]'); view with `tensorboard --logdir runs`."""


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    engine: EngineSection = field(default_factory=EngineSection)
    peer: PeerSection = field(default_factory=PeerSection)
    log: LogSection = field(default_factory=LogSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _convert(value: Any, typ: Any, where: str) -> Any:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        last: AtomError | None = None
        for option in typing.get_args(typ):
            if option is type(None):
                if value is None or value in ("", "none", "None"):
                    return None
                continue
            try:
                return _convert(value, option, where)
            except AtomError as e:
                last = e
        raise last or AtomError(f"{where}: invalid value {value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise AtomError(f"{where} expects true or false, got {value!r}")
    if typ in (int, float):
        if isinstance(value, bool):
            raise AtomError(f"{where} expects a number, got {value!r}")
        try:
            out = typ(value)
        except (TypeError, ValueError, OverflowError):
            raise AtomError(f"{where} expects {typ.__name__}, got {value!r}") from None
        if typ is int and isinstance(value, float) and value != out:
            raise AtomError(f"{where} expects an integer, got {value!r}")
        if typ is float and not math.isfinite(out):  # nan/inf train to NaN or never stop
            raise AtomError(f"{where} must be a finite number, got {value!r}")
        return out
    if typ is str:
        if not isinstance(value, str | int | float):
            raise AtomError(f"{where} expects a string, got {value!r}")
        return str(value)
    raise AtomError(f"{where}: unsupported field type {typ}")


def build(cls: type, values: dict[str, Any], where: str = "") -> Any:
    """An instance of dataclass `cls` from nested `values`, checked field by field."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            known = ", ".join(sorted(names))
            raise AtomError(f"unknown setting {where}{key}; known here: {known}")
    kwargs = {}
    for name in names & set(values):
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            if not isinstance(values[name], dict):
                raise AtomError(f"{where}{name} must be a section")
            kwargs[name] = build(typ, values[name], f"{where}{name}.")  # type: ignore[arg-type]
        else:
            kwargs[name] = _convert(values[name], typ, f"{where}{name}")
    return cls(**kwargs)


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`--section.field=value` (or `--section.field value`) pairs as a nested dict."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise AtomError(f"unrecognized argument {arg!r} (overrides look like --train.lr=1e-3)")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise AtomError(f"--{key} needs a value")
            value = args[i + 1]
            i += 1
        parts = key.split(".")
        if not all(parts):
            raise AtomError(f"malformed setting name --{key} (e.g. --train.lr=1e-3)")
        node = out
        *parents, leaf = parts
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise AtomError(f"--{key}: {p} is a value, not a section")
        if isinstance(node.get(leaf), dict):
            raise AtomError(f"--{key}: {leaf} is a section, not a value")
        node[leaf] = value
        i += 1
    return out


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_run_config(
    cls: type = RunConfig,
    path: str | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> Any:
    """Defaults, then `base` (e.g. a resumed run's config), the TOML file, then overrides."""
    values: dict[str, Any] = dict(base or {})
    if path:
        values = merge(values, read_toml(Path(path)))
    values = merge(values, parse_overrides(overrides or []))
    try:
        cfg = build(cls, values)
    except TypeError as e:  # a component's constructor rejected the combination
        raise AtomError(str(e)) from None
    if isinstance(cfg, RunConfig):
        from atomtrain.checks import resolve_and_validate

        given = "seq_len" in (values.get("data") or {})
        cfg = resolve_and_validate(cfg, seq_len_given=given)
    return cfg


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's tables, or AtomError naming the file and what is wrong with it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AtomError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise AtomError(f"config file {path} is a directory, not a TOML file") from None
    except UnicodeDecodeError:
        raise AtomError(f"config file {path} is not UTF-8 text") from None
    except OSError as e:
        raise AtomError(f"config file {path} cannot be read ({e.strerror})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise AtomError(f"config file {path} is not valid TOML: {e}") from None
