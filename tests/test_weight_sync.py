"""The colocated vLLM weight sync (the trainer and a sleeping engine on one GPU, CUDA IPC), as far as a CPU shows
it: vLLM's own IPC trainer engine runs with its few CUDA calls pointed at host memory, beside a recording
stand-in for `vllm.LLM` (sleep mode does not exist on CPU) that passes every call through vLLM's msgpack, as
its engine client does, and reads each update out of the packed buffer, as its workers do.

    python -m pytest tests/test_weight_sync.py -x      # skipped when vLLM is not installed
"""
import inspect
import os
import types

import pytest
import torch

pytest.importorskip("vllm")

import vllm  # noqa: E402
from torch.multiprocessing.reductions import rebuild_cuda_tensor  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from vllm import envs  # noqa: E402
from vllm.distributed.weight_transfer import packed_tensor  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from systems import distributed  # noqa: E402
from systems import weight_sync  # noqa: E402
from systems.engine import Sampling, VLLMEngine  # noqa: E402

UUID = "GPU-test"  # the GPU's identity in an IPC handle
PICKLE = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def tiny_lm():
    """A random Qwen3 whose tied embedding (512 x 128 fp32, 256 KiB) is its largest tensor."""
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True))


def ipc_args(t: torch.Tensor) -> tuple:
    """What torch's reduce_tensor makes of a CUDA tensor (rebuild_cuda_tensor's arguments), for a CPU tensor:
    its types, shape and dtype as they are, placeholder bytes where the driver's handles go."""
    return (type(t), t.size(), t.stride(), t.storage_offset(), type(t._typed_storage()), t.dtype, 0,
            b"storage-%d" % t.data_ptr(), t.untyped_storage().nbytes(), 0, t.requires_grad, b"refcount", 0,
            b"event", True)


class RecordingLLM:
    """`vllm.LLM` as the colocated engine calls it; every call is appended to `calls`. collective_rpc encodes its
    message as the engine client sends it (SyncMPClient.call_utility) and decodes it as the engine reads it;
    an update's tensors are read out of the packed buffer its handle names with vLLM's unpack_tensor."""

    def __init__(self, rig, **kwargs):
        self.rig, self.kwargs, self.pickle_at_start = rig, kwargs, os.environ.get(PICKLE)
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(
            hf_config=types.SimpleNamespace(tie_word_embeddings=True)))
        rig.llms.append(self)

    def collective_rpc(self, method, args=()):
        message = (0, 0, "collective_rpc", (method, None, args, None))
        _, _, _, (method, _, args, _) = MsgpackDecoder().decode(MsgpackEncoder().encode(message))
        self.rig.calls.append(method)
        if method == "update_weights":
            info = args[0]
            handle = info["ipc_handles"][UUID]
            self.rig.handles.append(handle)
            buffer = self.rig.buffers[handle[7]]
            sizes, dtypes = info["tensor_sizes"], [getattr(torch, d) for d in info["dtype_names"]]
            for name, t in packed_tensor.unpack_tensor(buffer[:sum(sizes)], info["names"], info["shapes"], dtypes,
                                                       sizes):
                self.rig.received[name] = t.clone()  # the producer reuses the buffer for the next chunk

    def sleep(self, level):
        self.rig.calls.append(f"sleep {level}")

    def wake_up(self, tags=None):
        self.rig.calls.append("wake " + " ".join(tags))

    def reset_prefix_cache(self):
        self.rig.calls.append("reset_prefix_cache")

    def generate(self, prompts, params, use_tqdm):
        self.rig.calls.append("generate")
        return []


@pytest.fixture
def rig(monkeypatch):
    """CUDA's part of vLLM's IPC trainer engine in host memory (the packed buffer, its handle, the device's
    identity), torch.cuda.empty_cache recorded, `vllm.LLM` replaced by RecordingLLM, and the environment
    variables the engine sets restored afterwards."""
    rig = types.SimpleNamespace(calls=[], buffers={}, handles=[], received={}, llms=[])
    for name in (PICKLE, "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(name, "0")  # recorded: teardown restores what was there before
        monkeypatch.delenv(name)
    envs.disable_envs_cache()  # vLLM caches its variables once an in-process engine started; these tests set them

    def reduce_tensor(t):
        rig.buffers[ipc_args(t)[7]] = t
        return rebuild_cuda_tensor, ipc_args(t)

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: empty(
        *a, device=None if device == "cuda" else device, **k))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid=UUID))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: rig.calls.append("empty_cache"))
    monkeypatch.setattr(packed_tensor, "reduce_tensor", reduce_tensor)
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: RecordingLLM(rig, **kwargs))
    return rig


def test_ipc_handles_cross_vllms_msgpack_only_when_it_may_pickle(rig, monkeypatch):
    """The updates vLLM's IPC trainer engine sends hold type objects and dtypes (rebuild_cuda_tensor's
    arguments): vLLM's msgpack refuses them after the workers started the update, and weight_sync.send finishes
    the update before raising. With pickling allowed they arrive intact, and so do the weights, in several
    chunks of a buffer (asked for 64 KiB) grown to the embedding's size."""
    assert len(ipc_args(torch.zeros(1))) == len(inspect.signature(rebuild_cuda_tensor).parameters)
    lm = tiny_lm()
    llm = RecordingLLM(rig)
    with pytest.raises(RuntimeError, match="mix of old and new weights") as failed:
        weight_sync.send(weight_sync.connect(llm, lm, "ipc", rank=0, engine_ranks=1, ipc_buffer=64 * 1024),
                         broadcast=False)
    assert isinstance(failed.value.__cause__, TypeError) and "not serializable" in str(failed.value.__cause__)
    assert rig.calls == ["init_weight_transfer_engine", "start_weight_update", "finish_weight_update"]

    rig.calls.clear()
    monkeypatch.setenv(PICKLE, "1")
    weight_sync.send(weight_sync.connect(llm, lm, "ipc", rank=0, engine_ranks=1, ipc_buffer=64 * 1024),
                     broadcast=False)
    chunks = len(rig.handles)
    assert chunks > 1 and rig.calls == ["init_weight_transfer_engine", "start_weight_update",
                                        *["update_weights"] * chunks, "finish_weight_update"]
    embed = lm.model.embed_tokens.weight
    assert rig.buffers[rig.handles[0][7]].numel() == embed.numel() * embed.element_size()
    sent = ipc_args(rig.buffers[rig.handles[0][7]])
    assert rig.handles[0] == [list(a) if isinstance(a, tuple) else a for a in sent]  # msgpack: tuples as lists
    assert rig.handles[0][0] is torch.Tensor and rig.handles[0][5] == torch.uint8
    weights = dict(distributed.hf_weights(lm))
    assert rig.received.keys() == weights.keys()
    assert all(torch.equal(rig.received[n], t) for n, t in weights.items())


def test_engine_allows_pickling_only_for_the_ipc_backend(rig):
    """The engine lets vLLM pickle only when it shares the trainer's GPU (IPC), and before its LLM exists."""
    for device, gpus in (("cpu", None), ("cuda", [6, 7]), ("cuda", None)):
        VLLMEngine("tiny", seed=0, dtype="float32", max_model_len=64, mem=0.1, device=device, gpus=gpus)
    backends = [llm.kwargs["weight_transfer_config"].backend for llm in rig.llms]
    assert backends == ["gloo", "nccl", "ipc"]
    assert [llm.pickle_at_start for llm in rig.llms] == [None, None, "1"]


def test_a_tensor_larger_than_the_packed_buffer_goes_through(rig):
    """With a buffer smaller than the embedding, vLLM's packed IPC producer refuses it; sized by
    ipc_buffer_size, every tensor goes through in chunks that fit, and unpacks equal to the original."""
    lm, least = tiny_lm(), 64 * 1024
    meta = weight_sync.HFSource(lm).metadata()
    embed = lm.model.embed_tokens.weight
    assert weight_sync.ipc_buffer_size(meta, least) == embed.numel() * embed.element_size() > least
    assert weight_sync.ipc_buffer_size(meta, 2**30) == 2**30
    with pytest.raises(ValueError, match="exceeds buffer_size_bytes"):
        list(packed_tensor.packed_ipc_producer(distributed.hf_weights(lm), UUID, lambda item: item[1], least))

    size, received = weight_sync.ipc_buffer_size(meta, least), {}
    for chunk in packed_tensor.packed_ipc_producer(distributed.hf_weights(lm), UUID, lambda item: item[1], size):
        assert sum(chunk.tensor_sizes) <= size
        buffer = rig.buffers[chunk.ipc_handle[UUID][7]]
        dtypes = [getattr(torch, d) for d in chunk.dtype_names]
        for name, t in packed_tensor.unpack_tensor(buffer[:sum(chunk.tensor_sizes)], chunk.names, chunk.shapes,
                                                   dtypes, chunk.tensor_sizes):
            received[name] = t.clone()
    weights = dict(distributed.hf_weights(lm))
    assert [m.name for m in meta] == list(received) == list(weights)
    assert all(torch.equal(received[n], t) for n, t in weights.items())


def test_colocated_engine_wakes_its_kv_cache_after_the_sync(rig):
    """pause, resume, update_weights: weights awake before the sync, the trainer's cached memory freed after
    it, then the KV cache. A step that updated nothing: the next generate wakes the KV cache the same way."""
    engine = VLLMEngine("tiny", seed=0, dtype="float32", max_model_len=64, mem=0.1, device="cuda")
    assert rig.calls == ["quiet_expected_reload_warnings"]
    rig.calls.clear()
    lm = tiny_lm()
    engine.pause()
    engine.resume()
    engine.update_weights(lm)
    assert rig.calls == ["sleep 1", "wake weights", "init_weight_transfer_engine", "start_weight_update",
                         "update_weights", "finish_weight_update", "empty_cache", "wake kv_cache",
                         "reset_prefix_cache"]
    assert all(torch.equal(rig.received[n], t) for n, t in distributed.hf_weights(lm))

    rig.calls.clear()
    engine.pause()
    engine.resume()
    engine.generate([], [], Sampling())
    engine.generate([], [], Sampling())
    assert rig.calls == ["sleep 1", "wake weights", "empty_cache", "wake kv_cache", "generate", "generate"]


def test_the_nccl_sender_gets_tensors_on_its_own_device_whatever_the_offload(monkeypatch):
    """--offload-optimizer keeps FSDP2's shards in host memory, so the gathered weights came out on the CPU and
    vLLM's NCCL sender, which asserts every tensor is on its communicator's device, failed at the first sync.
    Here the trainer's module is on the CPU (as offloaded) and a stand-in sender checks the device as vLLM's
    does; "meta" stands for the GPU this machine lacks."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert weight_sync.sender_device("nccl") == torch.device("cuda", 0)
    assert weight_sync.sender_device("gloo") is None and weight_sync.sender_device("ipc") is None
    device = torch.device("meta")
    lm = tiny_lm()
    source = weight_sync.HFSource(lm, torch.bfloat16, device)
    names = []
    for name, t in source:  # pynccl's broadcast: assert tensor.device == self.device
        assert t.device == device and t.dtype == torch.bfloat16, (name, t.device)
        names.append(name)
    assert names == [m.name for m in source.metadata()] and len(names) == len(list(lm.parameters()))


@pytest.mark.slow
def test_weight_sync_implements_the_installed_vllms_interface():
    """systems/weight_sync.py against the installed vLLM's own classes, so that a drift within 0.32 fails here, not on a
    GPU: every abstract method of the source, engine and trainer bases implemented with the base's parameters
    (vLLM calls them positionally and by name), the client's four calls as vLLM's client protocol declares
    them, and the worker methods they reach by name present on vLLM's CPU and GPU workers."""
    from vllm.distributed import weight_transfer as wt
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    def params(f):
        return [p.name for p in inspect.signature(f).parameters.values()]
    for ours, base in ((weight_sync.HFSource, wt.WeightSource), (weight_sync.GlooEngine, wt.WeightTransferEngine),
                       (weight_sync.GlooTrainer, wt.TrainerWeightTransferEngine)):
        assert not ours.__abstractmethods__ and base.__abstractmethods__, ours
        for name in base.__abstractmethods__:
            assert params(getattr(ours, name)) == params(getattr(base, name)), (ours.__name__, name)
    calls = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")
    for name in calls:
        assert params(getattr(weight_sync.LLMClient, name)) == params(getattr(VLLMWeightSyncClient, name)), name
        assert hasattr(Worker, name) and hasattr(CPUWorker, name), name
    from systems import engine
    engine.check_vllm(vllm.__version__)  # the installed one is the one supported


def test_a_slow_but_alive_load_passes_the_sync_watch_and_a_dead_one_ends_in_time(monkeypatch):
    """No tensor moves while vLLM's workers finish an update (each layer's post-load processing: seconds a GB at
    30B), and the watch stopped such a live sync at SYNC_STALL_S. Now the workers' start and finish may take
    SYNC_STALL_S plus the weights at LOAD_BYTES_PER_S (here 0.3 + 1.0 s): a finish of 0.8 s passes; one that never
    returns ends within that limit, as tensors that stop moving still end at SYNC_STALL_S."""
    monkeypatch.setattr(weight_sync, "SYNC_STALL_S", 0.3)
    monkeypatch.setattr(weight_sync, "LOAD_BYTES_PER_S", 1000.0)  # 1000 bytes of weights: a second

    class LLM:  # vLLM's engine as the client calls it: each rpc takes what `seconds` says
        def __init__(self, seconds):
            self.seconds = seconds

        def collective_rpc(self, method, args=()):
            time.sleep(self.seconds.get(method, 0.0))

    class Transfer:  # the trainer's transfer engine: start, tensors a few at a time, finish
        def __init__(self, finish_s, stop_after=None):
            self.client = weight_sync.LLMClient(LLM({"finish_weight_update": finish_s}))
            self.source = types.SimpleNamespace(moved=0.0, metadata=lambda: [
                weight_sync.ParamMeta("w", torch.float32, (250,))])
            self.stop_after = stop_after

        def send_weights(self):
            self.client.start_weight_update()
            for i in range(5):
                if i == self.stop_after:
                    time.sleep(1e6)  # a broadcast that never returns
                time.sleep(0.1)
                self.source.moved = time.monotonic()
            self.client.finish_weight_update()

    import time
    weight_sync.send(Transfer(finish_s=0.8), broadcast=True)
    for transfer, why, within in ((Transfer(finish_s=1e6), "did not start or finish the update in 1 s", 1.3),
                                  (Transfer(finish_s=0.0, stop_after=2), "no tensor moved for 0 s", 0.3)):
        start = time.monotonic()
        with pytest.raises(weight_sync.SyncFailed, match=why):
            weight_sync.send(transfer, broadcast=True)
        assert within < time.monotonic() - start < within + 1.0
