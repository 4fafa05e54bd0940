"""`accelerate launch` support: the settings it passes as environment variables, read as flags.

    accelerate launch --config_file configs/accelerate_fsdp.yaml [--num_processes N] \\
        T5_training.py [--field value ...]

runs this script through torch.distributed.run and hands it the config file only as environment
variables: ACCELERATE_MIXED_PRECISION, ACCELERATE_USE_FSDP=true and FSDP_*, which only accelerate's own
FullyShardedDataParallelPlugin reads; a plain script would ignore them silently (docs/pitfalls.md #23).
Here every one of them is mapped onto a field (ENV_RULES), accepted only at a value that changes nothing
here (CHECKED_VARIABLES), or listed with the reason it has no effect here (IGNORED_VARIABLES). Any other
FSDP_* variable, and any value with no meaning here, is a ConfigError naming the variable, the value and
the fix. configs/cli.py parses each mapped value with its flag's own types and bounds, under the command
line: an explicit flag wins, and the variables of its field are then not read at all.

The variables count only in a process that accelerate launched (it always sets ACCELERATE_MIXED_PRECISION),
and the FSDP_* ones only with ACCELERATE_USE_FSDP true, as in accelerate. Spellings follow accelerate
1.x (accelerate/utils/launch.py prepare_multi_gpu_env, utils/dataclasses.py FullyShardedDataParallelPlugin):
enums by name or by accelerate's number, booleans as accelerate's str_to_bool reads them.
"""

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import NoReturn

from configs.errors import ConfigError, UserError
from configs.fsdp import TESTED_LAYER_CLASSES

TRUE_WORDS = ("y", "yes", "t", "true", "on", "1")  # accelerate's str_to_bool
FALSE_WORDS = ("n", "no", "f", "false", "off", "0")

LAUNCHED_MARKER = "ACCELERATE_MIXED_PRECISION"  # accelerate launch sets it on every launcher
FSDP_SWITCH = "ACCELERATE_USE_FSDP"
FSDP_PREFIX = "FSDP_"
SHARDING = "FSDP_SHARDING_STRATEGY"
RESHARD = "FSDP_RESHARD_AFTER_FORWARD"

# accelerate's names, numbered 1-5 in this order (accelerate/utils/constants.py; torch's enum values)
SHARDING_NAMES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# each resharding strategy's form that keeps the parameters between forward and backward (FSDP2: false)
WITHOUT_RESHARD = {"FULL_SHARD": "SHARD_GRAD_OP", "HYBRID_SHARD": "HYBRID_SHARD_ZERO2"}
FIELD_SPELLING = {"HYBRID_SHARD_ZERO2": "_HYBRID_SHARD_ZERO2"}  # torch's (and --sharding_strategy's) name

Env = Mapping[str, str]


@dataclass(frozen=True)
class EnvRule:
    """One field set from accelerate launch's environment."""

    variables: tuple[str, ...]  # read together; the rule applies when any of them is set
    field: str  # a config field (configs/run.py), i.e. the flag --field
    convert: Callable[[Env], str | None]  # the flag's text; None: this setting leaves the field alone
    values: str  # what each spelling becomes (the table of docs/ecosystem.md)


def refuse(variable: str, value: str, reason: str) -> NoReturn:
    raise ConfigError(f"{variable}={value!r} (set by accelerate launch): {reason}")


def boolean_text(env: Env, variable: str) -> str:
    word = env[variable].strip().lower()
    if word in TRUE_WORDS:
        return "true"
    if word in FALSE_WORDS:
        return "false"
    refuse(variable, env[variable], "takes true or false")


def as_boolean(variable: str) -> Callable[[Env], str]:
    return lambda env: boolean_text(env, variable)


def as_is(variable: str) -> Callable[[Env], str]:
    return lambda env: env[variable].strip()


def as_choice(variable: str, spellings: dict[str, str], refusals: dict[str, str]) -> Callable[[Env], str]:
    """Map accelerate's spelling (case-insensitive) to the flag's; a spelling in `refusals` is refused with
    its reason, any other with the list of valid ones."""

    def convert(env: Env) -> str:
        word = env[variable].strip().upper()
        if word in spellings:
            return spellings[word]
        reason = refusals.get(word, f"takes {', '.join(spellings)} here")
        refuse(variable, env[variable], reason)

    return convert


def is_fsdp2(env: Env) -> bool:
    return env.get("FSDP_VERSION", "1").strip() == "2"


def strategy_name(env: Env, variable: str) -> str:
    """accelerate's name of a sharding strategy given by name or number (FSDP_SHARDING_STRATEGY's rules)."""
    word = env[variable].strip().upper()
    if word.isdigit() and 1 <= int(word) <= len(SHARDING_NAMES):
        return SHARDING_NAMES[int(word) - 1]
    if word.removeprefix("_") in SHARDING_NAMES:
        return word.removeprefix("_")
    refuse(variable, env[variable], f"takes {', '.join(SHARDING_NAMES)} or their numbers 1-5")


def fsdp1_sharding(env: Env, strategy: str) -> str:
    """FSDP1: accelerate takes FSDP_SHARDING_STRATEGY and ignores FSDP_RESHARD_AFTER_FORWARD, which
    `accelerate config` writes; refuse a reshard setting that says something else rather than drop it."""
    word = env.get(RESHARD, "true").strip().lower()
    if word in TRUE_WORDS:  # accelerate launch's default (FSDP2's spelling): says nothing under FSDP1
        return strategy
    wanted = WITHOUT_RESHARD.get(strategy, strategy) if word in FALSE_WORDS else strategy_name(env, RESHARD)
    if wanted == strategy:
        return strategy
    refuse(
        RESHARD,
        env[RESHARD],
        f"with FSDP_VERSION 1 accelerate takes the strategy from {SHARDING}={strategy} and ignores this one "
        f"({wanted}); set fsdp_sharding_strategy: {wanted} in the config file too, or give "
        f"--sharding_strategy {FIELD_SPELLING.get(wanted, wanted)}",
    )


def fsdp2_sharding(env: Env, strategy: str) -> str:
    """FSDP2: FSDP_RESHARD_AFTER_FORWARD (true/false) decides resharding; FSDP_SHARDING_STRATEGY, which
    accelerate ignores here, still chooses plain, hybrid or no sharding, as --sharding_strategy does."""
    word = env.get(RESHARD, "true").strip().lower()
    if word in FALSE_WORDS:
        return WITHOUT_RESHARD.get(strategy, strategy)
    if word not in TRUE_WORDS:
        refuse(RESHARD, env[RESHARD], "with FSDP_VERSION 2 it is true (FULL_SHARD) or false (SHARD_GRAD_OP)")
    if strategy in WITHOUT_RESHARD.values():
        refuse(
            SHARDING,
            env[SHARDING],
            f"with FSDP_VERSION 2 accelerate ignores it and reshards after forward ({RESHARD}=true); set "
            f"fsdp_reshard_after_forward: false for {strategy}, or give --sharding_strategy "
            f"{FIELD_SPELLING.get(strategy, strategy)}",
        )
    return strategy


def sharding_strategy(env: Env) -> str:
    strategy = strategy_name(env, SHARDING) if SHARDING in env else "FULL_SHARD"  # accelerate's default
    chosen = fsdp2_sharding(env, strategy) if is_fsdp2(env) else fsdp1_sharding(env, strategy)
    return FIELD_SPELLING.get(chosen, chosen)


def sync_module_states(env: Env) -> str | None:
    """accelerate drops the setting under FSDP2 (obsolete there), and demands it with rank-0-only loading,
    whose broadcast --cpu_ram_efficient_loading does itself here."""
    value = boolean_text(env, "FSDP_SYNC_MODULE_STATES")
    if is_fsdp2(env):
        return None
    rank0_loading = "FSDP_CPU_RAM_EFFICIENT_LOADING" in env and boolean_text(env, "FSDP_CPU_RAM_EFFICIENT_LOADING")
    return None if value == "true" and rank0_loading == "true" else value


def min_num_params(env: Env) -> str | None:
    """accelerate reads the threshold with the size-based policy only (and launch always sets it)."""
    policy = env.get("FSDP_AUTO_WRAP_POLICY", "").strip().upper()
    return env["FSDP_MIN_NUM_PARAMS"].strip() if policy == "SIZE_BASED_WRAP" else None


def device(env: Env) -> str | None:
    return "cpu" if boolean_text(env, "ACCELERATE_USE_CPU") == "true" else None


PRECISION_REFUSALS = {"FP8": "fp8 has no precision policy here: use bf16, fp16 (GPU) or no (fp32)"}
NO_WRAP_REASON = (
    "this package always shards the model in units (each stack layer, or by size); a single unit for the whole "
    "model is not supported: set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"
)
LOCAL_STATE_REASON = (
    "LOCAL_STATE_DICT (FSDP1's flat per-rank shards, loadable only on the same ranks and wrapping) is no "
    "checkpoint format here: use SHARDED_STATE_DICT (per-rank files through torch.distributed.checkpoint, "
    "loadable on any number of ranks) or FULL_STATE_DICT"
)

ENV_RULES = (
    EnvRule(("ACCELERATE_MIXED_PRECISION",), "mixed_precision",
            as_choice("ACCELERATE_MIXED_PRECISION", {"NO": "false", "BF16": "true", "FP16": "true"},
                      PRECISION_REFUSALS),
            "`no` -> false, `bf16`/`fp16` -> true; `fp8` refused"),
    EnvRule(("ACCELERATE_MIXED_PRECISION",), "use_fp16",
            as_choice("ACCELERATE_MIXED_PRECISION", {"NO": "false", "BF16": "false", "FP16": "true"},
                      PRECISION_REFUSALS),
            "`fp16` -> true, `bf16`/`no` -> false"),
    EnvRule(("ACCELERATE_USE_CPU",), "device", device, "true -> `cpu`; false: unchanged (`--device auto`)"),
    EnvRule(("ACCELERATE_GRADIENT_ACCUMULATION_STEPS",), "gradient_accumulation_steps",
            as_is("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"), "an integer >= 1"),
    EnvRule(("FSDP_VERSION",), "fsdp_version", as_is("FSDP_VERSION"), "1, 2"),
    EnvRule((SHARDING, RESHARD), "sharding_strategy", sharding_strategy,
            "FSDP1: the strategy by name or number 1-5 (`HYBRID_SHARD_ZERO2` -> `_HYBRID_SHARD_ZERO2`); "
            "the reshard variable must agree or be `true`. FSDP2: reshard `true` keeps the strategy, "
            "`false` gives its ZeRO-2 form (FULL_SHARD -> SHARD_GRAD_OP, HYBRID_SHARD -> _HYBRID_SHARD_ZERO2)"),
    EnvRule(("FSDP_OFFLOAD_PARAMS",), "fsdp_cpu_offload", as_boolean("FSDP_OFFLOAD_PARAMS"), "true, false"),
    EnvRule(("FSDP_AUTO_WRAP_POLICY",), "wrap_policy",
            as_choice("FSDP_AUTO_WRAP_POLICY",
                      {"TRANSFORMER_BASED_WRAP": "transformer", "SIZE_BASED_WRAP": "size_based"},
                      {"NO_WRAP": NO_WRAP_REASON}),
            "`TRANSFORMER_BASED_WRAP` -> transformer, `SIZE_BASED_WRAP` -> size_based; `NO_WRAP` refused"),
    EnvRule(("FSDP_MIN_NUM_PARAMS",), "min_num_params", min_num_params,
            "an integer >= 1, read with `SIZE_BASED_WRAP` only (as accelerate does)"),
    EnvRule(("FSDP_BACKWARD_PREFETCH",), "backward_prefetch",
            as_choice("FSDP_BACKWARD_PREFETCH",
                      {"BACKWARD_PRE": "BACKWARD_PRE", "1": "BACKWARD_PRE", "BACKWARD_POST": "BACKWARD_POST",
                       "2": "BACKWARD_POST", "NO_PREFETCH": "NONE"}, {}),
            "`BACKWARD_PRE` (1), `BACKWARD_POST` (2), `NO_PREFETCH` -> NONE"),
    EnvRule(("FSDP_FORWARD_PREFETCH",), "forward_prefetch", as_boolean("FSDP_FORWARD_PREFETCH"), "true, false"),
    EnvRule(("FSDP_STATE_DICT_TYPE",), "checkpoint_type",
            as_choice("FSDP_STATE_DICT_TYPE",
                      {"FULL_STATE_DICT": "FULL_STATE_DICT", "1": "FULL_STATE_DICT",
                       "SHARDED_STATE_DICT": "SHARDED_STATE_DICT", "3": "SHARDED_STATE_DICT"},
                      {"LOCAL_STATE_DICT": LOCAL_STATE_REASON, "2": LOCAL_STATE_REASON}),
            "`FULL_STATE_DICT` (1), `SHARDED_STATE_DICT` (3); `LOCAL_STATE_DICT` (2) refused"),
    EnvRule(("FSDP_USE_ORIG_PARAMS",), "use_orig_params", as_boolean("FSDP_USE_ORIG_PARAMS"), "true, false"),
    EnvRule(("FSDP_CPU_RAM_EFFICIENT_LOADING",), "cpu_ram_efficient_loading",
            as_boolean("FSDP_CPU_RAM_EFFICIENT_LOADING"), "true, false"),
    EnvRule(("FSDP_SYNC_MODULE_STATES",), "sync_module_states", sync_module_states,
            "true, false; not read with FSDP_VERSION 2 (accelerate drops it), nor when true with "
            "FSDP_CPU_RAM_EFFICIENT_LOADING true (the pair accelerate demands: rank-0 loading broadcasts itself)"),
    EnvRule(("FSDP_ACTIVATION_CHECKPOINTING",), "fsdp_activation_checkpointing",
            as_boolean("FSDP_ACTIVATION_CHECKPOINTING"), "true, false"),
)  # fmt: skip

ONLY_FALSE = FALSE_WORDS
LAYER_CLASSES_VARIABLE = "FSDP_TRANSFORMER_CLS_TO_WRAP"
# Variables accepted at these values only (compared case-insensitively; ONLY_FALSE: accelerate's spellings
# of false), with the reason and the fix.
CHECKED_VARIABLES = {
    LAYER_CLASSES_VARIABLE: (
        TESTED_LAYER_CLASSES,
        "the transformer policy here makes each layer of the model's stacks a unit, read from the model "
        "(docs/models.md): set fsdp_transformer_layer_cls_to_wrap to its layer classes, comma-separated (T5: "
        "T5Block; BART: BartEncoderLayer,BartDecoderLayer; Llama: LlamaDecoderLayer)",
    ),
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": (
        ONLY_FALSE,
        "activations are not offloaded to host memory here: set fsdp_activation_checkpointing_offload: false",
    ),
    "FSDP_IGNORED_MODULES": ((), "every module is sharded here: remove fsdp_ignored_modules"),
    "ACCELERATE_DYNAMO_BACKEND": (
        ("NO",),
        "accelerate's torch.compile of the whole model does not run here: set dynamo_backend: NO and give "
        "--compile true (each stack layer compiled with inductor)",
    ),
    "ACCELERATE_USE_DEEPSPEED": (ONLY_FALSE, "this package trains with FSDP: use distributed_type: FSDP"),
    "ACCELERATE_USE_MEGATRON_LM": (ONLY_FALSE, "this package trains with FSDP: use distributed_type: FSDP"),
    "ACCELERATE_USE_PARALLELISM_CONFIG": (
        ONLY_FALSE,
        "tensor, context and sequence parallelism are not implemented here: remove parallelism_config "
        "(--sharding_strategy HYBRID_SHARD gives replicas of sharded groups)",
    ),
}

DYNAMO_OPTION = "an option of accelerate's torch.compile, which runs only with a dynamo backend (refused above)"
# Variables accelerate launch sets that have no effect on training here, whatever their value.
IGNORED_VARIABLES = {
    FSDP_SWITCH: "no field of its own: true makes the FSDP_* variables count, as in accelerate",
    "ACCELERATE_DYNAMO_MODE": DYNAMO_OPTION,
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": DYNAMO_OPTION,
    "ACCELERATE_DYNAMO_USE_DYNAMIC": DYNAMO_OPTION,
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": DYNAMO_OPTION,
    "ACCELERATE_DEBUG_MODE": "checks inside accelerate's own collective operations, never called here",
    "ACCELERATE_CPU_AFFINITY": "NUMA pinning by accelerate's Accelerator, which this package does not create",
    "ACCELERATE_GRADIENT_CLIPPING": "read by accelerate's DeepSpeed plugin only (DeepSpeed is refused); "
    "clipping here is --max_grad_norm",
}


def launched_by_accelerate(environ: Env) -> bool:
    return LAUNCHED_MARKER in environ or FSDP_SWITCH in environ


def accelerate_environment(environ: Env) -> dict[str, str]:
    """The variables that count: ACCELERATE_*, and FSDP_* with ACCELERATE_USE_FSDP true; none at all in a
    process that accelerate did not launch."""
    if not launched_by_accelerate(environ):
        return {}
    fsdp = FSDP_SWITCH in environ and boolean_text(environ, FSDP_SWITCH) == "true"
    return {
        name: value
        for name, value in environ.items()
        if name.startswith("ACCELERATE_") or (fsdp and name.startswith(FSDP_PREFIX))
    }


def known_variables() -> set[str]:
    mapped = {variable for rule in ENV_RULES for variable in rule.variables}
    return mapped | set(CHECKED_VARIABLES) | set(IGNORED_VARIABLES)


def is_accepted(name: str, value: str) -> bool:
    """Whether `value` (a comma-separated list, as accelerate writes several layer classes) holds accepted
    values only."""
    accepted = {option.lower() for option in CHECKED_VARIABLES[name][0]}
    return all(part.strip().lower() in accepted for part in value.split(","))


def layer_classes_named(environ: Env) -> list[str]:
    """The layer classes accelerate launch's config names for the transformer policy (checked, not used: the
    units are the model's own layers); [] without it."""
    value = accelerate_environment(environ).get(LAYER_CLASSES_VARIABLE, "")
    return [part.strip() for part in value.split(",") if part.strip()]


def check_variables(env: Env) -> None:
    """Refuse an FSDP_* variable this package does not know, and a checked variable at another value."""
    known = known_variables()
    for name in sorted(env):
        if name.startswith(FSDP_PREFIX) and name not in known:
            refuse(name, env[name], "an accelerate FSDP setting this package does not know; remove it from the "
                   "config file (configs/accelerate_env.py lists the ones read)")  # fmt: skip
        if name in CHECKED_VARIABLES and not is_accepted(name, env[name]):
            refuse(name, env[name], CHECKED_VARIABLES[name][1])


def settings_from_accelerate(environ: Env, explicit: Collection[str]) -> dict[str, tuple[str, str]]:
    """{field: (its flag's text, the variables it came from)} for the settings accelerate launch passed,
    except the fields in `explicit` (given on the command line: flags win). Raises ConfigError."""
    env = accelerate_environment(environ)
    check_variables(env)
    settings = {}
    for rule in ENV_RULES:
        present = [variable for variable in rule.variables if variable in env]
        if rule.field in explicit or not present:
            continue
        text = rule.convert(env)
        if text is not None:
            settings[rule.field] = (text, "+".join(present))
    return settings


# The config file's key (and accelerate launch's flag) that sets each variable, where it is not the variable's
# name in lower case (FSDP_OFFLOAD_PARAMS: fsdp_offload_params).
CONFIG_KEYS = {
    LAYER_CLASSES_VARIABLE: "fsdp_transformer_layer_cls_to_wrap",
    "ACCELERATE_MIXED_PRECISION": "mixed_precision",
    "ACCELERATE_USE_CPU": "use_cpu",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
}


def config_keys(variables: str, environ: Env) -> str:
    """The accelerate config's keys, with their values, behind `variables` (settings_from_accelerate's "A+B")."""
    return ", ".join(
        f"{CONFIG_KEYS.get(name, name.lower())}: {environ[name].strip()}" for name in variables.split("+")
    )


def naming_config_keys(err: UserError, from_accelerate: Mapping[str, str], environ: Env) -> UserError:
    """`err`, a refusal of settings, with, for each flag it names that accelerate launch set ({field: variables},
    cli's fields_from_accelerate), the accelerate config's key that set it: the user wrote that key, not the flag.
    Any other error as it is."""
    named = {field: found.start() for field in from_accelerate if (found := re.search(rf"--{field}\b", str(err)))}
    if not isinstance(err, ConfigError) or not named:
        return err
    keys = "; ".join(
        f"--{field} is its {config_keys(from_accelerate[field], environ)}"
        for field in sorted(named, key=named.get)
    )
    return ConfigError(
        f"{err} [set by accelerate launch's config: {keys}. Change the config file, or give the flag here, which "
        "wins]"
    )


def mapping_markdown() -> str:
    """The table of ENV_RULES, CHECKED_VARIABLES and IGNORED_VARIABLES."""
    lines = ["| variable | field | values |", "| --- | --- | --- |"]
    for rule in ENV_RULES:
        variables = " + ".join(f"`{variable}`" for variable in rule.variables)
        lines.append(f"| {variables} | `--{rule.field}` | {rule.values} |")
    for name, (accepted, reason) in CHECKED_VARIABLES.items():
        shown = "false" if accepted == ONLY_FALSE else ", ".join(accepted)
        allowed = f"`{shown}` only" if shown else "any value refused"
        lines.append(f"| `{name}` | (checked) | {allowed}: {reason} |")
    for name, reason in IGNORED_VARIABLES.items():
        lines.append(f"| `{name}` | (no effect here) | {reason} |")
    return "\n".join(lines)
