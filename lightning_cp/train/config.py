"""Configuration: structured defaults, then a YAML file, then dotted ``key=value`` overrides (omegaconf)."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from lightning_cp.core.attention.api import MODES
from lightning_cp.core.mesh import default_context_parallel_size
from lightning_cp.core.runtime import LayerPolicy
from lightning_cp.core.zigzag import LAYOUT_NAMES
from lightning_cp.lightning.fsdp import DATA_PARALLEL_MODES
from lightning_cp.lightning.strategy import check_attention_settings
from lightning_cp.train.models.llama import LlamaConfig, layer_kinds
from lightning_cp.train.models.parallelize import check_tensor_parallel_size


def _choices(name: str, values: tuple[str, ...], aliases: dict[str, str] | None = None) -> type[Enum]:
    """An Enum whose member names are the accepted strings, so omegaconf checks them and YAML shows them plainly.

    A number given in YAML or on the command line (``trainer.precision=32``) finds the member of that spelling, an
    alias (``trainer.precision=16``, as Lightning reads it) the member it stands for.
    """
    choices = Enum(name, [(value, value) for value in values], type=str)
    spellings = {**(aliases or {}), **{value: value for value in values}}
    choices._missing_ = classmethod(lambda cls, value: cls._value2member_map_.get(spellings.get(str(value), "")))
    return choices


Accelerator = _choices("Accelerator", ("cpu", "gpu", "cuda", "auto"))
Precision = _choices(
    "Precision",
    ("64-true", "32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true"),
    aliases={"64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"},
)
BoundaryLayout = _choices("BoundaryLayout", LAYOUT_NAMES)
AttentionMode = _choices("AttentionMode", (*MODES, "auto"))
ProcessGroupBackend = _choices("ProcessGroupBackend", ("gloo", "nccl"))
DataParallel = _choices("DataParallel", DATA_PARALLEL_MODES)


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and what it accepts."""


@dataclass
class RunConfig:
    """Where the run folder goes: ``<root>/<name>``; ``name`` defaults to the start time."""

    root: str = "runs"
    name: str | None = None
    stop_on_nonfinite_loss: bool = True


@dataclass
class ModelConfig(LlamaConfig):
    """The built-in model's architecture, or ``pretrained``: a local Hugging Face folder (or hub name) to fine-tune."""

    pretrained: str | None = None


RUN_TIME_MODEL_KEYS = ("activation_checkpointing", "loss_chunk_tokens")
"""``model`` keys that say how the model runs, not what it is: a checkpoint fits whatever their values."""
NOT_ARCHITECTURE = ("pretrained", *RUN_TIME_MODEL_KEYS)


@dataclass
class DataConfig:
    """Documents, validation split, tokenizer and packing."""

    sources: list[str] = field(default_factory=lambda: ["pydoc"])
    tokenizer: str | None = None
    val_sources: list[str] | None = None
    val_fraction: float = 0.1
    split_seed: int = 0
    tokens_per_sample: int = 1024
    samples_per_batch: int = 1
    packed: bool = True
    shuffle: bool = True
    num_workers: int = 0


@dataclass
class TrainerConfig:
    """Arguments of ``lightning.pytorch.Trainer``."""

    accelerator: Accelerator = Accelerator["cpu"]
    devices: Any = 2
    num_nodes: int = 1
    precision: Precision = Precision["32-true"]
    max_steps: int = 300
    max_epochs: int | None = None
    val_check_interval: Any = 25
    limit_val_batches: Any = 1.0
    log_every_n_steps: int = 1
    gradient_clip_val: float | None = 1.0
    accumulate_grad_batches: int = 1
    num_sanity_val_steps: int = 0
    enable_progress_bar: bool = True
    deterministic: bool = False


@dataclass
class StrategyConfig:
    """Arguments of the ``cp_zigzag`` strategy."""

    context_parallel_size: int | None = 2
    tensor_parallel_size: int = 1
    data_parallel_size: Any = "auto"
    sequence_parallel: bool = False
    boundary_layout: BoundaryLayout = BoundaryLayout["contiguous"]
    attention_mode: AttentionMode = AttentionMode["allgather"]
    ulysses_size: int | None = None
    data_parallel: DataParallel = DataParallel["ddp"]
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    process_group_backend: ProcessGroupBackend | None = None
    timeout_s: float = 1800.0


@dataclass
class LayoutConfig:
    """Layout policy of ``ContextParallelLayoutCallback``: which blocks need zigzag or contiguous input."""

    zigzag_layers: list[str] = field(default_factory=lambda: list(LayerPolicy.zigzag_layers))
    contiguous_layers: list[str] = field(default_factory=lambda: list(LayerPolicy.contiguous_layers))
    side_inputs: list[str] = field(default_factory=lambda: list(LayerPolicy.side_inputs))
    log_metrics: bool = True
    check_consensus: bool = True


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay."""

    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1


@dataclass
class CheckpointConfig:
    """Checkpoint cadence, format (one full-state file, or with ``distributed`` a folder of shards written by every
    rank), fine-tuning start point and resumption."""

    every_n_steps: int = 50
    save_top_k: int = 1
    distributed: bool = False
    init_from: str | None = None
    resume_from: str | None = None


@dataclass
class Config:
    """The whole configuration of one ``lightning-cp`` run."""

    seed: int = 1234
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


POSITIVE = (
    "model.vocab_size",
    "model.hidden_size",
    "model.num_layers",
    "model.num_heads",
    "model.num_kv_heads",
    "model.intermediate_size",
    "data.tokens_per_sample",
    "data.samples_per_batch",
    "trainer.num_nodes",
    "trainer.accumulate_grad_batches",
    "strategy.tensor_parallel_size",
    "checkpoint.every_n_steps",
)


def _check_optimization(cfg: DictConfig) -> None:
    """Reject learning rates, betas and schedules that cannot train (or train into NaN)."""
    optim = cfg.optim
    if not 0.0 < optim.lr <= 10.0:
        raise ConfigError(f"optim.lr: got {optim.lr}; expected a number in (0, 10]")
    if len(optim.betas) != 2 or not all(0.0 <= beta < 1.0 for beta in optim.betas):
        raise ConfigError(f"optim.betas: got {list(optim.betas)}; expected two numbers in [0, 1)")
    if optim.weight_decay < 0 or optim.warmup_steps < 0 or not 0.0 <= optim.min_lr_ratio <= 1.0:
        raise ConfigError(
            f"optim: weight_decay={optim.weight_decay}, warmup_steps={optim.warmup_steps}, "
            f"min_lr_ratio={optim.min_lr_ratio}; expected weight_decay >= 0, warmup_steps >= 0, min_lr_ratio in [0, 1]"
        )
    trainer = cfg.trainer
    if trainer.max_steps == 0 or trainer.max_steps < -1 or (trainer.max_steps == -1 and trainer.max_epochs is None):
        raise ConfigError(
            f"trainer.max_steps: got {trainer.max_steps}; expected an integer >= 1 (or -1 with trainer.max_epochs)"
        )
    if trainer.max_epochs is not None and trainer.max_epochs != -1 and trainer.max_epochs < 1:
        raise ConfigError(f"trainer.max_epochs: got {trainer.max_epochs}; expected null, -1 or an integer >= 1")
    if trainer.gradient_clip_val is not None and trainer.gradient_clip_val < 0:
        raise ConfigError(
            f"trainer.gradient_clip_val: got {trainer.gradient_clip_val}; expected null or 0 (no clipping), or more"
        )
    limit = trainer.limit_val_batches
    if isinstance(limit, bool) or not (
        (isinstance(limit, int) and limit >= 0) or (isinstance(limit, float) and 0.0 <= limit <= 1.0)
    ):
        raise ConfigError(
            f"trainer.limit_val_batches: got {limit}; expected batches (an integer >= 0) or a fraction in [0, 1]"
        )
    interval = trainer.val_check_interval
    if isinstance(interval, bool) or not (
        (isinstance(interval, int) and interval >= 1) or (isinstance(interval, float) and 0.0 < interval <= 1.0)
    ):
        raise ConfigError(
            f"trainer.val_check_interval: got {interval}; expected steps (an integer >= 1) or a fraction in (0, 1]"
        )


def _check_model(model: DictConfig) -> None:
    """Reject architectures the built-in model cannot build (nothing to check for a pretrained one)."""
    if model.pretrained:
        return
    if model.hidden_size % model.num_heads or model.num_heads % model.num_kv_heads:
        raise ConfigError(
            f"model: hidden_size={model.hidden_size}, num_heads={model.num_heads}, num_kv_heads={model.num_kv_heads}; "
            "expected hidden_size divisible by num_heads and num_heads by num_kv_heads"
        )
    if (model.hidden_size // model.num_heads) % 2:
        raise ConfigError(
            f"model: head dim {model.hidden_size // model.num_heads} is odd; rotary embeddings need it even"
        )
    if model.vocab_size < 257:
        raise ConfigError(f"model.vocab_size: got {model.vocab_size}; the byte tokenizer needs at least 257")
    if not model.init_std > 0:
        raise ConfigError(f"model.init_std: got {model.init_std}; expected a standard deviation > 0")
    if model.loss_chunk_tokens < 0:
        raise ConfigError(f"model.loss_chunk_tokens: got {model.loss_chunk_tokens}; expected 0 (whole logits) or more")
    try:
        layer_kinds(model.num_layers, model.layer_types)
    except ValueError as error:
        raise ConfigError(f"model.{error}") from None


def _list_set_by_index(layer: DictConfig, prefix: str = "") -> str | None:
    """The first key that ``layer`` sets item by item (``key.0=...``, a mapping of indices), or None."""
    for key, value in layer.items():
        if isinstance(value, DictConfig):
            if value and all(str(index).isdigit() for index in value):
                return f"{prefix}{key}"
            found = _list_set_by_index(value, f"{prefix}{key}.")
            if found:
                return found
    return None


def _schema_node(full_key: str) -> tuple[type | None, str]:
    """Return the dataclass holding ``full_key`` (or None) and the key's last part."""
    node: Any = Config
    *parents, leaf = full_key.split(".")
    for part in parents:
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return None, leaf
        node = typing.get_type_hints(node)[part]
    return (node if dataclasses.is_dataclass(node) else None), leaf


def _describe(full_key: str) -> str:
    """Describe what ``full_key`` accepts: its choices, or its declared type (an item's, for ``key[i]``)."""
    field_key = full_key.split("[", 1)[0]
    holder, leaf = _schema_node(field_key)
    if holder is None:
        return "a value"
    hint = typing.get_type_hints(holder)[leaf]
    if field_key != full_key and typing.get_args(hint):
        hint = typing.get_args(hint)[0]
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    if optional:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if isinstance(hint, type) and issubclass(hint, Enum):
        return "one of " + ", ".join(["null"] * optional + [member.name for member in hint])
    text = hint.__name__ if typing.get_origin(hint) is None else str(hint)
    return f"a value of type {text}" + (" or null" if optional else "")


def _explain(error: OmegaConfBaseException, origin: str, layer: Any) -> ConfigError:
    """Turn an omegaconf error into one line naming the key and the allowed keys or values."""
    full_key = getattr(error, "full_key", None) or ""
    if isinstance(error, ConfigKeyError) or "not in" in str(error):
        holder, leaf = _schema_node(full_key)
        section = full_key.rsplit(".", 1)[0] if "." in full_key and holder else "top level"
        allowed = ", ".join(f.name for f in dataclasses.fields(holder or Config))
        key = full_key or leaf
        key = key if len(key) <= 60 else f"{key[:57]}..."  # a text file read as YAML is one long key
        return ConfigError(f"unknown key '{key}' in {origin}; allowed keys in {section}: {allowed}")
    if isinstance(error, ValidationError):
        value = OmegaConf.select(layer, full_key, default="?", throw_on_missing=False)
        return ConfigError(f"{full_key}: got '{value}'; expected {_describe(full_key)} (in {origin})")
    return ConfigError(f"{origin}: {str(error).splitlines()[0]}")


def _check_sharding(cfg: DictConfig) -> None:
    """Check the FSDP options and tensor parallelism against the data-parallel mode and the model's sizes."""
    strategy = cfg.strategy
    fsdp = strategy.data_parallel.value == "fsdp"
    tp = strategy.tensor_parallel_size
    if tp > 1 and not fsdp:
        raise ConfigError(f"strategy.tensor_parallel_size: {tp} needs strategy.data_parallel=fsdp")
    if strategy.cpu_offload and not fsdp:
        raise ConfigError("strategy.cpu_offload: true needs strategy.data_parallel=fsdp")
    if tp > 1 and cfg.model.pretrained:
        raise ConfigError(
            f"strategy.tensor_parallel_size: {tp} with model.pretrained; tensor parallelism has a plan for the "
            "built-in model only"
        )
    if tp > 1 and not cfg.model.pretrained:
        try:
            check_tensor_parallel_size(cfg.model, tp)
        except ValueError as error:
            raise ConfigError(f"strategy.{error}") from None
    if tp > 1 and cfg.trainer.precision.value == "16-mixed":
        raise ConfigError("trainer.precision: 16-mixed with strategy.tensor_parallel_size > 1; use bf16-mixed")


def _check_values(cfg: DictConfig) -> None:
    """Check positive sizes and the world size against cp x tp (omegaconf checked types and choices)."""
    for key in POSITIVE:
        value = OmegaConf.select(cfg, key)
        if value < 1:
            raise ConfigError(f"{key}: got {value}; expected an integer >= 1")
    if cfg.data.tokens_per_sample < 2:
        raise ConfigError(
            f"data.tokens_per_sample: got {cfg.data.tokens_per_sample}; expected at least 2 (a token is predicted from "
            "the one before it)"
        )
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: got {cfg.data.val_fraction}; expected a number in [0, 1)")
    _check_optimization(cfg)
    _check_model(cfg.model)
    strategy = cfg.strategy
    if strategy.sequence_parallel and strategy.tensor_parallel_size == 1:
        raise ConfigError("strategy.sequence_parallel: true needs strategy.tensor_parallel_size > 1")
    if not strategy.timeout_s > 0:
        raise ConfigError(f"strategy.timeout_s: got {strategy.timeout_s}; expected seconds > 0")
    dp = strategy.data_parallel_size
    if dp != "auto" and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 1):
        raise ConfigError(f"strategy.data_parallel_size: got '{dp}'; expected auto or an integer >= 1")
    if cfg.checkpoint.save_top_k < -1:
        raise ConfigError(
            f"checkpoint.save_top_k: got {cfg.checkpoint.save_top_k}; expected -1 (keep every step checkpoint), "
            "0 (only last.ckpt) or a positive count"
        )
    cp = cfg.strategy.context_parallel_size
    if cp is not None and cp < 1:
        raise ConfigError(f"strategy.context_parallel_size: got {cp}; expected an integer >= 1 or null")
    devices = cfg.trainer.devices
    process_count = isinstance(devices, int) and not isinstance(devices, bool) and devices > 0
    accelerator = cfg.trainer.accelerator.value
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu and not process_count:
        shown = list(devices) if OmegaConf.is_list(devices) else f"'{devices}'" if isinstance(devices, str) else devices
        raise ConfigError(f"trainer.devices: got {shown}; on CPU give the number of processes (cp x tp x dp)")
    per_node = len(devices) if OmegaConf.is_list(devices) else devices
    tp = cfg.strategy.tensor_parallel_size
    known_devices = isinstance(per_node, int) and not isinstance(per_node, bool) and per_node > 0
    try:
        cp_known = default_context_parallel_size(cp, per_node, tp) if known_devices else cp
        check_attention_settings(
            strategy.attention_mode.value, strategy.ulysses_size, strategy.sequence_parallel, cp_known
        )
    except ValueError as error:
        raise ConfigError(f"strategy.{error}") from None
    if known_devices:
        world = per_node * cfg.trainer.num_nodes
        group = cp_known * tp
        if world % group:
            raise ConfigError(
                f"world size {world} (trainer.devices={per_node} x trainer.num_nodes={cfg.trainer.num_nodes}) "
                f"is not divisible by strategy.context_parallel_size x strategy.tensor_parallel_size = {group}"
            )
        if dp != "auto" and dp * group != world:
            raise ConfigError(
                f"strategy.data_parallel_size={dp} x context_parallel_size x tensor_parallel_size = {dp * group} is "
                f"not the world size {world}: give {world // group} or auto"
            )
    elif not (isinstance(devices, str) and devices == "auto") and not OmegaConf.is_list(devices) and devices != -1:
        raise ConfigError(f"trainer.devices: got '{devices}'; expected a positive integer, a list of ids, -1 or auto")
    _check_sharding(cfg)


def packaged_configs() -> Path:
    """Return the folder of the configs shipped inside the package."""
    return Path(str(resources.files("lightning_cp.train"))) / "configs"


def resolve_config_path(name: str) -> Path:
    """Return the YAML file ``name``: a path, or the name of a packaged config (``cp4_cpu``, ``gpu``, ...)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    packaged = packaged_configs() / f"{name.removesuffix('.yaml')}.yaml"
    if packaged.is_file():
        return packaged
    available = ", ".join(
        sorted(p.name.removesuffix(".yaml") for p in packaged_configs().iterdir() if p.name.endswith(".yaml"))
    )
    raise ConfigError(f"--config {name}: no such file and no packaged config of that name (packaged: {available})")


def load_config(config_file: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Merge the structured defaults, the YAML file and the ``key=value`` overrides; fail on bad keys or values."""
    cfg = OmegaConf.structured(Config)
    layers: list[tuple[str, Any]] = []
    if config_file is not None:
        path = resolve_config_path(config_file)
        try:
            layer = OmegaConf.load(path)
        except Exception as error:  # noqa: BLE001 - any YAML problem becomes one clear line
            raise ConfigError(f"{path}: not a valid YAML mapping ({str(error).splitlines()[0]})") from None
        if not isinstance(layer, DictConfig):
            raise ConfigError(f"{path}: not a YAML mapping of sections (got a {type(layer).__name__})")
        layers.append((str(path), layer))
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override '{override}' is not of the form key=value (e.g. trainer.max_steps=100)")
    if overrides:
        try:
            layers.append(("the command line", OmegaConf.from_dotlist(list(overrides))))
        except OmegaConfBaseException as error:
            raise ConfigError(f"command line: {str(error).splitlines()[0]}") from None
    for origin, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as error:
            raise _explain(error, origin, layer) from None
        except TypeError as error:  # omegaconf's answer to `key.0=value` for a list `key`
            key = _list_set_by_index(layer)
            if key is None:
                raise ConfigError(f"{origin}: {error}") from None
            raise ConfigError(f"{key} (from {origin}) is a list: give it whole, e.g. {key}=[a,b]") from None
    _check_values(cfg)
    if cfg.model.pretrained:
        defaults = OmegaConf.structured(ModelConfig)
        for origin, layer in layers:
            model_layer = layer.get("model") or {}
            given = [key for key in model_layer if key not in NOT_ARCHITECTURE and model_layer[key] != defaults[key]]
            if given:
                raise ConfigError(
                    f"model.{given[0]} (from {origin}) is an architecture key of the built-in model, but "
                    f"model.pretrained={cfg.model.pretrained} brings its own architecture: remove it"
                )
    return cfg


def plain(node: DictConfig) -> dict[str, Any]:
    """Return a configuration section as plain Python values (choices as their strings), for constructors."""
    return OmegaConf.to_container(node, enum_to_str=True)


def to_yaml(cfg: DictConfig) -> str:
    """Return the configuration as YAML text."""
    return OmegaConf.to_yaml(cfg)
