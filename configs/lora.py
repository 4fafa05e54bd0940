"""LoRA adapters through PEFT (utils/model/lora.py): off unless --peft lora."""

from dataclasses import dataclass
from typing import Literal

from configs.options import option


@dataclass
class LoraConfig:
    peft: Literal["none", "lora"] = option(
        default="none",
        help=(
            "lora: train LoRA adapters (PEFT's get_peft_model) on the frozen model; only the adapters get "
            "gradients and AdamW state. Under FSDP1 each adapter is a unit of its own. Needs: pip install peft."
        ),
        on_resume="fixed",
    )
    lora_r: int = option(default=8, help="With --peft lora: the adapters' rank.", minimum=1, on_resume="fixed")
    lora_alpha: int = option(
        default=32,
        help="With --peft lora: the scale numerator (the update is alpha/r x BA).",
        minimum=1,
        on_resume="fixed",
    )
    lora_dropout: float = option(
        default=0.1, help="With --peft lora: dropout on the adapters' input.", minimum=0, maximum=1
    )
    lora_target_modules: str = option(
        default="auto",
        help=(
            "With --peft lora: comma-separated names of the linear layers that get adapters (T5: q,k,v,o,wi,wo; "
            "BART: q_proj,k_proj,v_proj,out_proj,fc1,fc2). auto: the family's attention query and value "
            "(PEFT's default: q,v for T5 and mT5, q_proj,v_proj for BART). all-linear: every linear layer but the "
            "output head (PEFT's shorthand)."
        ),
        on_resume="fixed",
    )
    merge_lora: bool = option(
        default=False,
        help=(
            "With --peft lora: besides the adapter (hf_adapter/), export hf_model/ with the adapters merged "
            "into the weights, loadable without PEFT."
        ),
    )
