"""The names this package registers with SGLang (no SGLang import: the launcher, the plugin, the algorithm and the
attention backend all read them here)."""

ALGORITHM = "ReFusion"  # `--dllm-algorithm ReFusion`: `sglang_algorithm.ReFusion`
ATTENTION_BACKEND = "refusion_torch_native"  # `--attention-backend`: `sglang_attention.MaskedTorchNativeAttnBackend`
