from .configuration_refusion import RefusionConfig
from .modeling_refusion import RefusionForCausalLM

__all__ = ["RefusionConfig", "RefusionForCausalLM"]
