"""How new weights reach vLLM: its weight-transfer API, driven from the trainer.

vLLM 0.32 moves a trainer's weights into a running engine through a pluggable transfer with a start /
update / finish protocol (docs: "Weight Transfer"): `WeightTransferConfig(backend=...)` on the engine, and
`WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)` then `send_weights()` on
every trainer rank. Its finish phase runs each layer's post-load processing, which a bare in-place reload
skips. This file supplies the three pieces the trainer needs:

- `HFSource`: the trainer's weights as vLLM reads them, in the checkpoint's layout and names (transformers
  keeps a Mixture-of-Experts layer's experts fused in one tensor; a checkpoint, and vLLM's loader, one per
  expert), gathered from the FSDP shards a decoder layer at a time (distributed.hf_weights).
- `LLMClient`: the control plane, four calls on the `vllm.LLM` object (`collective_rpc` to its workers,
  in this process or in the engine's own); `send` finishes the workers' update when a sync fails midway.
- a gloo backend (`GlooEngine` in the workers, `GlooTrainer` in the trainer), registered in vLLM's
  factories beside its NCCL (engine on GPUs of its own) and CUDA-IPC (engine sharing the trainer's GPU)
  backends: the same protocol on CPU, over a process group of its own between trainer rank 0 and the
  engine's workers. It also re-applies two CPU-only post-load steps that vLLM 0.32 skips on a weight update
  (measured: the tiny engines' log-probs off by 0.1-3 nats without them, 1e-6 with them): the tied lm_head's
  repack, and the Mixture-of-Experts experts' prepacked layout.

vLLM's workers import this file (`WorkerExtension`, given as worker_extension_cls), which registers the gloo
backend there before the engine is created.
"""
import logging
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import (ParamMeta, TrainerWeightTransferEngine, WeightSource,
                                              WeightTransferEngine, WeightTransferEngineFactory,
                                              WeightTransferTrainerFactory)
from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

from systems import distributed

TIMEOUT = timedelta(minutes=30)  # a rendezvous or one tensor's broadcast; a 30B model's sync takes seconds


class HFSource(WeightSource):
    """The trainer's module as vLLM reads it: checkpoint names and layout, in `dtype` (the engine's: no
    point shipping fp32 master weights to a bf16 engine), a decoder layer at a time, on `device`: the sender's
    (sender_device). Iterating is a collective under FSDP: every trainer rank walks it in step."""

    def __init__(self, lm, dtype: torch.dtype | None = None, device: torch.device | None = None):
        self.lm, self.dtype, self.device = lm, dtype, device
        self._meta = [ParamMeta(name, dtype or t.dtype, tuple(t.shape))
                      for name, t in distributed.hf_weights(lm, on_meta=True)]
        self.moved = time.monotonic()  # when the sender last took a tensor (send's watchdog)

    def metadata(self) -> list[ParamMeta]:
        return self._meta

    def __iter__(self):
        for name, t in distributed.hf_weights(self.lm, dtype=self.dtype):  # cast before the gather, as gather_only
            self.moved = time.monotonic()
            yield name, t if self.device is None or t.device == self.device else t.to(self.device)


def sender_device(backend: str) -> torch.device | None:
    """Where the tensors a sender gets must be: vLLM's NCCL sender takes tensors on the trainer's own GPU only
    (its communicator asserts it), while an FSDP2 run with --offload-optimizer gathers its shards in host
    memory. The packed CUDA-IPC sender copies any tensor into its buffer; gloo sends from host memory. None:
    where they are."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None


class LLMClient:
    """The four control-plane calls of vLLM's `VLLMWeightSyncClient` protocol, on an `LLM`. `updating`: the
    workers were told to start an update and not yet to finish it."""

    def __init__(self, llm):
        self.llm, self.updating = llm, False
        # since when the workers start or finish an update (no tensor moves then), and when they last did: send's watch
        self.loading, self.loaded = None, 0.0

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def start_weight_update(self) -> None:
        self.loading = time.monotonic()
        try:
            self.llm.collective_rpc("start_weight_update")
        finally:
            self.loading, self.loaded = None, time.monotonic()
        self.updating = True

    def update_weights(self, update_info) -> None:
        self.llm.collective_rpc("update_weights", args=(update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.loading = time.monotonic()
        try:
            self.llm.collective_rpc("finish_weight_update")
        finally:
            self.loading, self.loaded = None, time.monotonic()
        self.updating = False


class NoClient:
    """Trainer ranks other than 0 hold no engine: the transfer engines never call their client."""
    updating = False


class SyncFailed(RuntimeError):
    """A sync that failed while the engine's workers were receiving by broadcast (gloo, NCCL): they wait inside
    a broadcast that will never complete, and so would any call to finish their update. The engine must be torn
    down; the run stops with this error."""


SYNC_STALL_S = 60.0  # a sync in which no tensor moves for this long has failed (a 30B model's takes seconds)
# While the workers prepare or finish loading (each layer's post-load processing: repacking, quantizing) no tensor
# moves; that phase may take SYNC_STALL_S plus the model's bytes at this rate (a 30B model in bf16: 60 + 122 s)
LOAD_BYTES_PER_S = 0.5e9


def load_limit(source) -> float:
    """Seconds the workers' start or finish of an update may take: SYNC_STALL_S and the weights at LOAD_BYTES_PER_S."""
    return SYNC_STALL_S + sum(math.prod(m.shape) * m.dtype.itemsize for m in source.metadata()) / LOAD_BYTES_PER_S


def send(transfer, broadcast: bool, engine_alive=None) -> None:
    """`transfer.send_weights()`, which calls start, update and finish on the workers with nothing around them:
    one that fails after start (the trainer's side: packing, an out-of-memory error, a CUDA error) leaves the
    workers mid-update. Receiving by broadcast (`broadcast`: gloo, NCCL) they are blocked in it: SyncFailed,
    for the caller to tear the engine down. Receiving by CUDA IPC they are not: they are finished before the
    error goes up (a layer that received nothing gets its old weights back), and the error says the engine's
    weights are mixed.
    The sync runs in a thread of its own, watched: an engine that died (`engine_alive()` false), workers that
    failed to load a tensor (the gloo sender sees their error), no tensor moved for SYNC_STALL_S (a worker that
    never returns; an NCCL broadcast has no timeout), or the workers' start or finish of the update (their own
    loading, when no tensor moves) past load_limit is SyncFailed at once, with the sync thread left
    blocked where it is: the caller tears the engine down, and the process must end without waiting for it
    (vLLM's own update thread, orphaned in that broadcast, is joined at interpreter exit)."""
    outcome, done = {}, threading.Event()
    # a thread starts on CUDA's device 0: the sync's gathers and sends run on this rank's own GPU
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run():
        try:
            if device is not None:
                torch.cuda.set_device(device)
            transfer.send_weights()
        except BaseException as e:  # noqa: B036 -- handed to the caller's thread
            outcome["error"] = e
        finally:
            done.set()
    transfer.source.moved = time.monotonic()
    limit = load_limit(transfer.source)
    threading.Thread(target=run, name="weight sync", daemon=True).start()
    while not done.wait(0.2):
        failed, client = getattr(transfer, "failed", None), transfer.client
        loading = getattr(client, "loading", None)  # the workers' own start or finish of the update: no tensor moves
        quiet = time.monotonic() - max(transfer.source.moved, loading or getattr(client, "loaded", 0.0))
        why = None
        if engine_alive is not None and not engine_alive():
            why = "the engine's process died"
        elif failed:
            why = f"the engine's workers failed to load the weights ({type(failed[0]).__name__}: {failed[0]})"
        elif loading is not None and quiet > limit:
            why = f"the engine's workers did not start or finish the update in {limit:.0f} s"
        elif loading is None and quiet > SYNC_STALL_S:
            why = f"no tensor moved for {SYNC_STALL_S:.0f} s"
        if why:
            raise SyncFailed(f"the weight sync failed while the engine's workers were receiving: {why}")
    e = outcome.get("error")
    if e is None:
        return
    if not transfer.client.updating:
        raise e
    if broadcast:
        died = "the engine's process died " if engine_alive is not None and not engine_alive() else ""
        raise SyncFailed(f"the weight sync failed while the engine's workers were receiving: {died}"
                         f"({type(e).__name__}: {e})") from e
    transfer.client.finish_weight_update()
    raise RuntimeError("the weight sync failed after the engine's workers started the update; they finished it "
                       "with the tensors that had arrived, and hold a mix of old and new weights: sync again "
                       "before generating") from e


def ipc_buffer_size(meta: list[ParamMeta], least: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES) -> int:
    """Bytes of the packed CUDA-IPC buffer: `least` (vLLM's default, 1 GiB), or the model's largest tensor when
    that is larger, since vLLM's packing refuses a tensor that does not fit (Qwen3-8B's bf16 embedding is
    1.25 GB). Sizes are known before sending, from the source's metadata."""
    return max([least] + [math.prod(m.shape) * m.dtype.itemsize for m in meta])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(llm, lm, backend: str, rank: int, engine_ranks: int, dtype: torch.dtype | None = None,
            ipc_buffer: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES):
    """The trainer side of the transfer, on every trainer rank (rank 0 drives the engine `llm`; the others
    take part in the gathers): a vLLM `TrainerWeightTransferEngine` whose `send_weights()` moves the weights
    of `lm` into the engine's `engine_ranks` workers. `ipc_buffer`: the packed CUDA-IPC buffer's least size."""
    source = HFSource(lm, dtype, sender_device(backend))
    if backend == "gloo":
        info = GlooTrainerInitInfo(rank=rank, port=free_port() if rank == 0 else 0, world_size=1 + engine_ranks)
    elif backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        info = NCCLTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=free_port() if rank == 0 else 0,
                                   world_size=1 + engine_ranks)
    elif backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
        # through one reused buffer, not the whole model at once (the engine wakes its weights beside the trainer's)
        info = IPCTrainerInitInfo(rank=rank, packed=True,
                                  packed_buffer_size_bytes=ipc_buffer_size(source.metadata(), ipc_buffer))
    else:
        raise ValueError(f"unknown weight-transfer backend {backend!r}")
    return WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm) if rank == 0 else NoClient(),
                                                     source=source)


# ------------------------------------------------------------------------------------- the gloo backend

def _group(host: str, port: int, rank: int, world: int):
    """A gloo process group of its own between trainer rank 0 (rank 0 here) and the engine's workers: the
    default group belongs to torchrun's trainer ranks, and inside vLLM's workers to vLLM."""
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=TIMEOUT)
    return dist.ProcessGroupGloo(dist.PrefixStore("ulorl_weights", store), rank, world, TIMEOUT)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooEngine(WeightTransferEngine):
    """The worker side: receives each tensor by broadcast from trainer rank 0 and loads it, inside vLLM's
    layerwise reload (start/finish), as the NCCL backend does."""
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = 1 + self.parallel_config.rank  # after trainer rank 0
        self.group = _group(init_info.host, init_info.port, rank, init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            self.group.broadcast(t, 0).wait()
            self.model.load_weights([(name, t)])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        finalize_layerwise_reload(self.model, self.model_config)
        m = self.model
        for layer in m.modules():  # vLLM repacks CPU experts at load only, not on a weight update
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            if isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
                kernel.fused_experts.process_weights_after_loading(layer)
        if getattr(m, "lm_head", None) is not None and m.lm_head.weight is m.model.embed_tokens.weight:
            m.lm_head.quant_method.process_weights_after_loading(m.lm_head)  # a tied lm_head keeps its old copy

    def shutdown(self) -> None:
        self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "gloo"
    port: int = 0
    world_size: int = 2  # trainer rank 0 + the engine's workers
    host: str = "127.0.0.1"


class GlooTrainer(TrainerWeightTransferEngine):
    """The trainer side: rank 0 broadcasts each tensor of the source while the workers receive it (their
    update_weights runs beside, as in vLLM's NCCL backend); other ranks only take part in the gathers."""
    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:  # the workers wait in init for the rendezvous: open our end beside
            with ThreadPoolExecutor(1) as pool:
                done = pool.submit(client.init_weight_transfer_engine,
                                   {"host": init_info.host, "port": init_info.port, "world_size": init_info.world_size})
                engine.group = _group(init_info.host, init_info.port, 0, init_info.world_size)
                done.result()
        return engine

    def send_weights(self) -> None:
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        meta = self.source.metadata()
        self.client.start_weight_update()
        # the workers receive beside the broadcasts, in a thread nobody waits for if they fail: the workers are
        # then blocked in a broadcast for good, and the caller tears the engine down (send, which watches `failed`)
        self.failed = failed = []
        receiving = threading.Thread(target=lambda: self._receive(meta, failed), daemon=True)
        receiving.start()
        sent = 0
        try:
            for (name, t), m in zip(self.source, meta):
                assert name == m.name and tuple(t.shape) == m.shape, (name, m)
                self.group.broadcast(t.detach().to("cpu").contiguous(), 0).wait()
                sent += 1
        except BaseException:  # zeros for the rest, so that a worker in this process is not left blocked
            for m in meta[sent:]:
                self.group.broadcast(torch.zeros(m.shape, dtype=m.dtype), 0).wait()
            raise
        receiving.join()
        if failed:
            raise failed[0]
        self.client.finish_weight_update()

    def _receive(self, meta: list[ParamMeta], failed: list) -> None:
        try:
            self.client.update_weights({"names": [m.name for m in meta],
                                        "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
                                        "shapes": [list(m.shape) for m in meta]})
        except Exception as e:
            failed.append(e)


def register() -> None:
    """Put the gloo backend in vLLM's factories (in this process: the trainer's, or an engine worker's)."""
    for factory, cls in ((WeightTransferEngineFactory, GlooEngine), (WeightTransferTrainerFactory, GlooTrainer)):
        try:
            factory.register_engine("gloo", cls)
        except ValueError:  # registered already
            pass


register()


class ExpectedReloadWarnings(logging.Filter):
    """vLLM's layerwise reload warns "<layer>: Failed to load weights" for every layer with a loadable tensor that
    an update did not send. Two of them say nothing is wrong: RotaryEmbedding (its cos/sin cache is a buffer,
    rebuilt from the config, in no checkpoint) and, with tied embeddings, ParallelLMHead (its weight is the
    embedding's, which the update sends; GlooEngine re-applies its CPU repack). Any other layer's is shown."""

    def __init__(self, tied: bool):
        super().__init__()
        self.expected = {"RotaryEmbedding"} | ({"ParallelLMHead"} if tied else set())

    def filter(self, record: logging.LogRecord) -> bool:
        layer, _, rest = record.getMessage().partition(": ")
        return not (rest == "Failed to load weights" and layer in self.expected)


# On a CPU with AMX, vLLM's CPU attention runs AMX tiles in bfloat16 without asking Linux for them first
# (arch_prctl ARCH_REQ_XCOMP_PERM): an engine process that has run no AMX matmul of torch's own dies of SIGILL
# ("Illegal instruction") at its first forward. Its workers import this file before the model loads: ask here.
torch.cpu._init_amx()


class WorkerExtension:
    """vLLM's workers import this class (worker_extension_cls), and with it this file: the gloo backend is
    then registered where the engine is created."""

    def quiet_expected_reload_warnings(self, tied: bool) -> None:
        """Called on every worker (collective_rpc) once the engine is up."""
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(ExpectedReloadWarnings(tied))
