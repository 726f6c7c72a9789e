"""refusion_hf: ReFusion masked-diffusion LLMs as first-class Hugging Face Transformers models.

Importing the package registers `RefusionConfig` with `AutoConfig` and `RefusionForCausalLM` with `AutoModel`
and `AutoModelForCausalLM` (Dream / LLaDA users load diffusion LMs with `AutoModel`; they get the LM-head model
with `generate()`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .generation import RefusionGenerationConfig, RefusionGenerationMixin, RefusionGenerationOutput
from .modeling import RefusionConfig, RefusionForCausalLM
from .training import RefusionDataCollator
from .version import __version__ as __version__


def __getattr__(name: str):
    if name == "RefusionSFTTrainer":  # TRL, imported on first use
        from .training.sft import RefusionSFTTrainer

        return RefusionSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


AutoConfig.register(RefusionConfig.model_type, RefusionConfig, exist_ok=True)
AutoModel.register(RefusionConfig, RefusionForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(RefusionConfig, RefusionForCausalLM, exist_ok=True)


__all__ = [
    "RefusionConfig",
    "RefusionDataCollator",
    "RefusionForCausalLM",
    "RefusionGenerationConfig",
    "RefusionGenerationMixin",
    "RefusionGenerationOutput",
    "RefusionSFTTrainer",
]
