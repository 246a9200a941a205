"""``DecodeLoader(decode_in="process")``: the whole decode pipeline in a process of its own.

Both GPU JPEG decoders take the GIL back about once per image inside their batched call, so in the
training process every line of the loop's own Python slows them (H200, results/jpeg_lanes_h200 run 4:
beside a thread running Python, nvJPEG fell from 38k to 231 img/s, the hardware engines from 34k to 75).
Here one child interpreter runs a ``DecodeLoader`` of the same cache and options (its read-ahead, CPU
decoders, hardware and nvJPEG lanes, the measured split and the transform); the training process only
hands it each epoch's batches (its own order, so ``state_dict``/``set_epoch`` are the parent's as
always) and receives the results.

Batches come back through a ring of ``RING`` slots made by the child at its first batch: CUDA memory
shared once through CUDA IPC (shared memory on the CPU), with an interprocess event per slot each way.
Per batch the child waits for the slot's "free" event, copies the batch into it, records its "ready"
event and sends (slot, count, the target on the host); the parent makes its stream wait on "ready",
copies the slot into a batch of its own (one device copy), records "free" and says so. Nothing waits on
the host in the parent but the message. The child is a fresh interpreter (``engines.workers``: no
multiprocessing spawn of the user's script); it exits when its socket closes, so a killed parent leaves
nothing behind.
"""

from __future__ import annotations

import copy
import io
import pickle
import signal
import time
import traceback
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

from dlstore.errors import DlstoreError
from dlstore.read.engines.workers import START_TIMEOUT_S, start_interpreter, worker_connection

RING = 4  # result slots: the child runs this many batches ahead of the training loop at most
DRAIN_TIMEOUT_S = 60.0  # an epoch left early: how long the child may take to stop


class DecodeProcess:
    """The parent's side: starts the child with ``recipe`` (what it needs to build its loader), runs
    epochs through it and stops it."""

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        self.device = device
        self.ring: _Ring | None = None
        self.stats: Any = None
        self.split: Any = None
        self._tag = 0
        payload = _dumps(recipe)
        self.conn, self.proc = start_interpreter("dlstore.read.decode_process")
        self._finalizer = weakref.finalize(self, _shutdown, self.conn, self.proc)
        self._ready = False
        try:
            self.conn.send_bytes(payload)
        except BaseException:
            self.close()
            raise

    def wait_ready(self) -> DecodeProcess:
        """Until the child has built its loader (processes started together start in parallel)."""
        if not self._ready:
            try:
                kind, *rest = self._recv(START_TIMEOUT_S, "starting")
                if kind != "ready":
                    raise _as_error(rest[0], "while opening the cache in the decode process")
            except BaseException:
                self.close()
                raise
            self._ready = True
        return self

    def epoch(self, batches: list[list[int]], tunables: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
        """The batches decoded in the child, in order, each on this process's current stream (the
        child starts on them now, not at the first ``next``)."""
        self._tag += 1
        _send(self.conn, ("epoch", self._tag, batches, tunables))
        return self._receive(self._tag)

    def _receive(self, tag: int) -> Iterator[tuple[Any, Any]]:
        ended = False
        try:
            while True:
                msg = self._recv(None, "decoding")
                if msg[0] == "ring":
                    self._new_ring(msg[1])
                elif msg[0] == "batch":
                    yield self._take(*msg[2:])
                elif msg[0] == "end":
                    ended = True
                    self._ended(*msg[2:])
                    return
        finally:
            if not ended and self.proc.poll() is None:
                self._stop(tag)

    def _new_ring(self, handle: bytes) -> None:
        self._drop_ring()
        self.ring = _Ring.open(handle, self.device)

    def _drop_ring(self) -> None:
        """Let go of the child's slots once this process's copies out of them have run: the child frees
        (and may reuse) their memory when this process lets go."""
        if self.ring is not None and self.ring.ready:
            torch.cuda.synchronize(self.ring.tensors[0].device)
        self.ring = None

    def _take(self, slot: int, count: int, target: Any) -> tuple[Any, Any]:
        assert self.ring is not None
        images = self.ring.take(slot, count)
        _send(self.conn, ("free", slot))
        return images, _target_to(target, self.device)

    def _ended(self, stats: Any, split: Any, error: Any) -> None:
        self.stats, self.split = stats, split
        if error is not None:
            raise _as_error(error, "in the decode process")

    def _stop(self, tag: int) -> None:
        """An epoch left early: the child stops it; the batches it sent meanwhile free their slots."""
        try:
            _send(self.conn, ("stop", tag))
            while True:
                msg = self._recv(DRAIN_TIMEOUT_S, "stopping an epoch")
                if msg[0] == "ring":
                    self._new_ring(msg[1])
                elif msg[0] == "batch":
                    _send(self.conn, ("free", msg[2]))
                elif msg[0] == "end":
                    self.stats, self.split = msg[2], msg[3]
                    return
        except (DlstoreError, OSError):  # it does not answer: a fresh one starts with the next epoch
            self.close()

    def _recv(self, timeout: float | None, doing: str) -> tuple[Any, ...]:
        """The child's next message; its exit (or ``timeout``) is an error naming what it was doing."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None:
                raise self._died(doing)
            if deadline is not None and time.monotonic() > deadline:
                raise DlstoreError(f"the decode process did not answer within {timeout:.0f} s while {doing}")
        try:
            return pickle.loads(self.conn.recv_bytes())  # type: ignore[no-any-return]
        except (EOFError, OSError) as e:
            raise self._died(doing) from e

    def _died(self, doing: str) -> DlstoreError:
        try:
            code: Any = self.proc.wait(5)
        except Exception:
            code = "none yet: it closed its socket"
        return DlstoreError(
            f"the decode process exited (code {code}) while {doing}; its error, if any, is printed "
            "above. Iterating the loader again starts a new one; decode_in='thread' decodes in this "
            "process instead"
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Drop the shared slots (before the child that owns them exits), then stop the child."""
        try:
            self._drop_ring()
        finally:
            self._finalizer()


def interleaved(
    procs: list[DecodeProcess], batches: list[list[int]], tunables: dict[str, Any]
) -> Iterator[tuple[Any, Any]]:
    """The epoch through ``procs`` at once: process i decodes batches i, i + n, ...; yielded in order."""
    n = len(procs)
    parts = [p.epoch(batches[i::n], tunables) for i, p in enumerate(procs)]
    try:
        for j in range(len(batches)):
            yield next(parts[j % n])
        for part in parts:  # each child's end of epoch: its stats, and any error it met
            for _ in part:
                raise AssertionError("a decode process sent more batches than it was given")
    finally:
        for part in parts:
            part.close()


def merged_stats(procs: list[DecodeProcess]) -> Any:
    """The children's DecodeStats summed (the CPU share averaged; the lanes of the first)."""
    stats = [p.stats for p in procs if p.stats is not None]
    if not stats:
        return None
    out = copy.copy(stats[0])
    for name, value in vars(out).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total = sum(getattr(s, name) for s in stats)
            setattr(out, name, total / len(stats) if name == "cpu_share" else total)
    return out


def _shutdown(conn: Connection, proc: Any) -> None:
    from dlstore.read.engines.workers import shutdown_interpreter

    shutdown_interpreter(conn, proc)


class _Ring:
    """The result slots as each side sees them: ``tensors`` (RING, B, ...) and, on CUDA, the child's
    "ready" and the parent's "free" event per slot."""

    def __init__(self, tensors: list[torch.Tensor], ready: list[Any], free: list[Any], keep: Any = None):
        self.tensors, self.ready, self.free, self._keep = tensors, ready, free, keep

    @classmethod
    def make(cls, like: torch.Tensor, batch_size: int, slots: int) -> tuple[_Ring, bytes]:
        """In the child: slots for batches like ``like`` (up to ``batch_size``), and what opens them."""
        shape = (batch_size, *like.shape[1:])
        layout = (
            torch.channels_last
            if like.dim() == 4
            and not like.is_contiguous()
            and like.is_contiguous(memory_format=torch.channels_last)
            else torch.contiguous_format
        )
        if like.device.type == "cuda":
            tensors = [
                torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=layout)
                for _ in range(slots)
            ]
            ready = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
            free = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
            buf = io.BytesIO()
            ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(("cuda", tensors, ready, free))
            return cls(tensors, ready, free), buf.getvalue()
        from multiprocessing import shared_memory

        nbytes = int(np.prod(shape)) * like.element_size()
        shm = shared_memory.SharedMemory(create=True, size=max(1, nbytes * slots))
        _untrack(shm)  # the parent unlinks it once mapped (a tracker here would unlink it at our exit)
        tensors = [
            _over(shm.buf[i * nbytes : (i + 1) * nbytes], shape, like.dtype, layout) for i in range(slots)
        ]
        return cls(tensors, [], [], keep=shm), pickle.dumps(
            ("cpu", shm.name, shape, like.dtype, layout, slots)
        )

    @classmethod
    def open(cls, handle: bytes, device: torch.device) -> _Ring:
        """In the parent: the child's slots (and events) from ``make``'s handle."""
        kind, *rest = pickle.loads(handle)
        if kind == "cuda":
            tensors, ready, free = rest
            return cls(tensors, ready, free)
        from multiprocessing import shared_memory

        name, shape, dtype, layout, slots = rest
        shm = shared_memory.SharedMemory(name=name)
        shm.unlink()  # both sides have it mapped: nothing is left in /dev/shm whatever happens next
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        tensors = [_over(shm.buf[i * nbytes : (i + 1) * nbytes], shape, dtype, layout) for i in range(slots)]
        return cls(tensors, [], [], keep=shm)

    def fits(self, images: torch.Tensor) -> bool:
        t = self.tensors[0]
        return (
            images.dtype == t.dtype
            and images.device == t.device
            and tuple(images.shape[1:]) == tuple(t.shape[1:])
            and images.shape[0] <= t.shape[0]
        )

    def put(self, slot: int, images: torch.Tensor) -> None:
        """In the child: ``images`` into ``slot`` once the parent's copy of its last batch is done."""
        if self.free:
            stream = torch.cuda.current_stream(images.device)
            stream.wait_event(self.free[slot])
            self.tensors[slot][: images.shape[0]].copy_(images)
            self.ready[slot].record(stream)
        else:
            self.tensors[slot][: images.shape[0]].copy_(images)

    def take(self, slot: int, count: int) -> torch.Tensor:
        """In the parent: a batch of its own, copied from ``slot`` on the current stream."""
        source = self.tensors[slot][:count]
        if not self.ready:
            return source.clone()
        stream = torch.cuda.current_stream(source.device)
        stream.wait_event(self.ready[slot])
        out = source.clone()
        self.free[slot].record(stream)
        return out


def _over(buf: Any, shape: tuple[int, ...], dtype: torch.dtype, layout: torch.memory_format) -> torch.Tensor:
    flat = torch.frombuffer(buf, dtype=dtype)
    if layout == torch.channels_last:
        n, c, h, w = shape
        return flat.view(n, h, w, c).permute(0, 3, 1, 2)
    return flat.view(shape)


def _untrack(shm: Any) -> None:
    from dlstore.read.engines.workers import _untrack as untrack

    untrack(shm)


def _moved(t: torch.Tensor, move: Any) -> torch.Tensor:
    """``move`` applied to ``t``, keeping a tv_tensor's type and metadata (boxes' format, canvas)."""
    from torchvision import tv_tensors

    if isinstance(t, tv_tensors.TVTensor):
        return tv_tensors.wrap(move(t.as_subclass(torch.Tensor)), like=t)  # type: ignore[no-any-return]
    return move(t)  # type: ignore[no-any-return]


def _to_host(target: Any) -> Any:
    """The target with every tensor on the CPU (labels, or a collated dict of tensors and lists)."""
    if isinstance(target, torch.Tensor):
        return _moved(target, lambda t: t.cpu())
    if isinstance(target, dict):
        return {k: _to_host(v) for k, v in target.items()}
    if isinstance(target, (list, tuple)):
        return type(target)(_to_host(v) for v in target)
    return target


def _target_to(target: Any, device: torch.device) -> Any:
    if isinstance(target, torch.Tensor):
        if device.type == "cuda":
            return _moved(target, lambda t: t.pin_memory().to(device, non_blocking=True))
        return target
    if isinstance(target, dict):
        return {k: _target_to(v, device) for k, v in target.items()}
    if isinstance(target, (list, tuple)):
        return type(target)(_target_to(v, device) for v in target)
    return target


def _send(conn: Connection, msg: tuple[Any, ...]) -> None:
    """A message by plain pickle (targets by value: multiprocessing's pickler would pass CPU tensors as
    shared-memory descriptors, which need an authkey these unrelated interpreters do not share)."""
    conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))


def _dumps(obj: Any) -> bytes:
    try:
        return pickle.dumps(obj)
    except Exception as e:
        raise ValueError(
            f"decode_in='process' sends the loader's options and transform to its process, and this one "
            f"cannot be pickled ({e}); use a transform defined at module level (not a lambda), or "
            "decode_in='thread'"
        ) from e


def _error(exc: BaseException) -> tuple[Any, str]:
    """An exception as the parent can raise it again: the object if it pickles, and its traceback."""
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))
        return exc, text
    except Exception:
        return None, text


def _as_error(error: tuple[Any, str], where: str) -> BaseException:
    exc, text = error
    if exc is not None:
        return exc  # type: ignore[no-any-return]
    return DlstoreError(f"{where}:\n{text}")


# ---- the child ------------------------------------------------------------------------------------


def main() -> None:
    """The child: build the loader from the recipe, then serve epochs until the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; we exit when it hangs up
    conn = worker_connection()
    try:
        recipe = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    try:
        from dlstore.read.gpu_decode import DecodeLoader

        device = torch.device(recipe["device"])
        if device.type == "cuda":
            if device.index is not None:
                torch.cuda.set_device(device.index)
            stream = torch.cuda.Stream(device)  # batches handed over and copied out here, not stream 0
            torch.cuda.set_stream(stream)
        _seed(recipe["transform"], recipe.get("seed"), recipe.get("rank", 0))
        loader = DecodeLoader(
            recipe["path"], recipe["batch_size"], recipe["transform"], device, **recipe["options"]
        )
    except BaseException as e:
        _send(conn, ("failed", _error(e)))
        return
    _send(conn, ("ready",))
    server = _Server(conn, loader, recipe["batch_size"], recipe.get("ring", RING))
    try:
        server.serve()
    except (EOFError, OSError, BrokenPipeError):
        pass
    finally:
        server.ring = None
        loader.close()


def _seed(transform: Any, seed: int | None, rank: int) -> None:
    """This process's random numbers: torch's from ``seed + rank``; a transform's own generator is
    reseeded too, except in the first process (which then draws as the loader in one process would)."""
    if seed is None:
        return
    torch.manual_seed(seed + rank)
    generator = getattr(transform, "generator", None)
    if rank > 0 and isinstance(generator, torch.Generator):
        generator.manual_seed(seed + rank)


class _Server:
    def __init__(self, conn: Connection, loader: Any, batch_size: int, slots: int) -> None:
        self.conn, self.loader, self.batch_size, self.slots = conn, loader, batch_size, slots
        self.ring: _Ring | None = None
        self.in_use: set[int] = set()
        self.stopped: set[int] = set()

    def serve(self) -> None:
        while True:
            msg = pickle.loads(self.conn.recv_bytes())
            if msg[0] == "epoch":
                self.epoch(*msg[1:])
            else:
                self.handle(msg)

    def handle(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "free":
            self.in_use.discard(msg[1])
        elif msg[0] == "stop":
            self.stopped.add(msg[1])

    def epoch(self, tag: int, batches: list[list[int]], tunables: dict[str, Any]) -> None:
        for name, value in tunables.items():
            setattr(self.loader, name, value)
        error = None
        it = self.loader._decode_epoch(batches)
        try:
            for images, target in it:
                slot = self.free_slot(tag)
                if slot is None:
                    break
                if not isinstance(images, torch.Tensor):
                    raise TypeError(
                        "decode_in='process' hands back one batch tensor; this transform returned "
                        f"{type(images).__name__} (use decode_in='thread')"
                    )
                if self.ring is None or not self.ring.fits(images):
                    self.ring, handle = _Ring.make(images, max(self.batch_size, images.shape[0]), self.slots)
                    self.in_use.clear()
                    _send(self.conn, ("ring", handle))
                self.ring.put(slot, images)
                self.in_use.add(slot)
                _send(self.conn, ("batch", tag, slot, int(images.shape[0]), _to_host(target)))
        except BaseException as e:  # the loader's error for the parent (a lost socket fails the send below)
            error = _error(e)
        finally:
            it.close()
        self.stopped.discard(tag)
        _send(self.conn, ("end", tag, self.loader.stats, self.loader.split, error))

    def free_slot(self, tag: int) -> int | None:
        """A slot the parent is done with (waiting for one), or None when it stopped this epoch."""
        while True:
            while self.conn.poll(0):
                self.handle(pickle.loads(self.conn.recv_bytes()))
            if tag in self.stopped:
                return None
            free = [s for s in range(self.slots) if s not in self.in_use]
            if free:
                return free[0]
            self.conn.poll(None)
