"""One run's settings: the tutorial's two sections and the sections this package adds, side by side.

Each component is handed its own section (the data loaders `config.data`, the checkpoint manager
`config.checkpointing`, ...), never the whole run. Every field of every section is a flag (configs/cli.py),
and field names are unique across sections, so `--field value` needs no section prefix.
"""

from dataclasses import dataclass, field

from configs.checkpointing import CheckpointConfig
from configs.data import DataConfig
from configs.evaluation import EvalConfig
from configs.fsdp import FSDPConfig
from configs.lora import LoraConfig
from configs.observability import ObserveConfig
from configs.recipe import RecipeConfig
from configs.training import TrainConfig


@dataclass
class RunConfig:
    train: TrainConfig = field(default_factory=TrainConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)


# Per section: the title of its --help group and of its table in docs/configuration.md, and its key in
# output_dir/config.json (the tutorial's two keep their names: train_config, fsdp_config).
SECTION_TITLES = {
    "train": "Training (`configs/training.py`, the tutorial's train_config)",
    "fsdp": "FSDP (`configs/fsdp.py`, the tutorial's fsdp_config)",
    "data": "Data (`configs/data.py`)",
    "recipe": "Training recipe (`configs/recipe.py`)",
    "evaluation": "Evaluation: generation and its scores (ROUGE or accuracy) (`configs/evaluation.py`)",
    "checkpointing": "Checkpointing (`configs/checkpointing.py`)",
    "lora": "LoRA (`configs/lora.py`)",
    "observe": "Observability (`configs/observability.py`)",
}
RECORD_KEYS = {
    "train": "train_config",
    "fsdp": "fsdp_config",
    "data": "data_config",
    "recipe": "recipe_config",
    "evaluation": "evaluation_config",
    "checkpointing": "checkpointing_config",
    "lora": "lora_config",
    "observe": "observability_config",
}
