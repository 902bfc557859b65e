"""vLLM's CPU platform for fp8kv's tests, loaded by vLLM's platform loader (`vllm.platform_plugins`)
in each of vLLM's processes. vLLM asks platform plugins only when VLLM_TARGET_DEVICE is unset."""


def platform_class() -> str:
    """The entry point: vLLM's platform loader activates the platform it names. No other platform
    activates on a machine without a GPU (vLLM's own CPU platform needs vLLM's CPU build)."""
    return "fp8kv_test_vllm_platform.platform.TestCpuPlatform"
