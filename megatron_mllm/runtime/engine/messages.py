"""One rank's point-to-point messages for one step: tagged (gloo) or ordered (NCCL's matching).

* Tagged: each message carries a tag from its key, so two messages between the same pair of
  ranks never depend on the order they were posted in. Receives are posted when needed, with
  the next `lookahead` of this rank's program (any sender) posted with them; by default every
  receive of the program goes up with the first one. gloo moves a message only once its
  receive is posted, so a receive posted when its tensor is needed waits for the whole
  exchange (the sender's transport thread woken on a busy core included), where one posted
  ahead finds the tensor there. All at the first: the look-ahead's dense program measured
  2.6-3.1% shorter than with two ahead (docs/performance.md, look-ahead (17)); a posted gloo
  receive holds only a host buffer.
* Ordered (NCCL has no tags): every message goes with tag 0 on a process group of its own
  direction (src, dst), and each sender's messages are received in the order it sends them.
  Receives are posted lazily: when key k from sender s is needed, s's not-yet-posted receives
  up to k are posted in s's order, then at most `lookahead` more while no more than
  `lookahead` + 1 of s's are outstanding. Posting every receive at step start instead would
  queue them behind each other on NCCL (a deadlock with CUDA_DEVICE_MAX_CONNECTIONS=1) and keep
  every micro-batch's buffer alive from the start.

Sends keep their tensor until they complete; completed ones are dropped as the step goes on.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_mllm.runtime.engine.program import Op

# Receives posted beyond the one being waited for, per sender, when ordered (NCCL); tagged
# (gloo) posts every receive of the program at the first by default.
RECV_LOOKAHEAD = 2


class PeerFailure(RuntimeError):
    """A message did not arrive: names this rank, the action waited on and the peer."""


@contextlib.contextmanager
def naming_peer(rank: int, op: Op, what: str = "failed on") -> Iterator[None]:
    """Turn a transport error raised inside into a PeerFailure naming rank, op and peer
    ("rank 0: could not post SEND:key->rank1 (peer rank 1): <the transport's first line>")."""
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise PeerFailure(f"rank {rank}: {what} {op} (peer rank {op.peer}): {first}") from None


class Messages:
    """Posts, waits for and releases one step's messages (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        shape_of: Callable[[str], tuple[int, ...]],
        timeout_s: float,
        ordered: tuple[dict, dict] | None = None,
        lookahead: int | None = None,
        dtype: torch.dtype = torch.float32,
        receives: list[Op] = (),
    ) -> None:
        self.rank, self.device, self.shape_of = rank, device, shape_of
        self.dtype = dtype  # the pipeline dtype: every message is an activation or its gradient
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # (receive orders {src: keys in the sender's posting order}, {(src, dst): group}).
        self.ordered = ordered
        if lookahead is None:  # the mode's default
            lookahead = RECV_LOOKAHEAD if ordered is not None else len(receives)
        self.lookahead = lookahead
        self.max_posted_ahead: dict[int, int] = {}  # sender -> most outstanding at once
        self.pending: list[tuple] = []  # (work, op, tensor) of sends in flight
        self._posted: dict[tuple[str, int], tuple] = {}  # (key, sender) -> (work, buffer)
        # Tagged: this rank's receives in program order (`receives`), posted up to `_ahead`.
        self._receives, self._ahead = list(receives), 0
        self._at = {(op.key, op.peer): i for i, op in enumerate(self._receives)}
        self._outstanding: Counter[int] = Counter()  # sender -> receives posted, not yet waited
        if len(self._at) < len(self._receives):
            raise ValueError(f"rank {rank}: a message received twice in one program")
        if ordered is not None:
            orders = ordered[0]
            self._index = {s: {k: i for i, k in enumerate(ks)} for s, ks in orders.items()}
            self._next = dict.fromkeys(orders, 0)

    # -- sends -------------------------------------------------------------------------------
    def send(self, op: Op, tensor: torch.Tensor) -> None:
        """Post a send; the message keeps `tensor` alive until it completes."""
        tensor = tensor.contiguous()
        with naming_peer(self.rank, op, "could not post"):
            if self.ordered is not None:
                group = self.ordered[1][(self.rank, op.peer)]
                work = dist.isend(tensor, op.peer, group=group, tag=0)
            else:
                work = dist.isend(tensor, op.peer, tag=op.tag)
        self.pending.append((work, op, tensor))

    def reap(self) -> None:
        """Drop the sends that have completed (and their tensors)."""
        still = []
        for work, op, tensor in self.pending:
            with naming_peer(self.rank, op):
                done = work.is_completed()
            if done:
                self.wait(work, op)  # returns at once; raises what the send ran into
            else:
                still.append((work, op, tensor))
        self.pending = still

    def drain(self) -> None:
        """Wait for every send still in flight (at step end); a receive posted and never taken
        is an error (its message would meet the next step's receive)."""
        for work, op, _ in self.pending:
            self.wait(work, op)
        self.pending = []
        if self._posted:
            left = sorted(f"{key} from rank {src}" for key, src in self._posted)[:3]
            raise RuntimeError(f"rank {self.rank}: receives posted and never taken: {left}")

    # -- receives ----------------------------------------------------------------------------
    def receive(self, op: Op) -> tuple[object, torch.Tensor]:
        """(work, buffer) of the message `op` waits for, posted if it was not yet."""
        if self.ordered is None:
            with naming_peer(self.rank, op, "could not post the receive for"):
                return self._tagged(op)
        keys, want = self.ordered[0][op.peer], self._index[op.peer][op.key]
        with naming_peer(self.rank, op, "could not post the receive for"):
            while self._next[op.peer] <= want:  # what the sender sends first is received first
                self._post_next(op.peer, keys)
            while (
                self._next[op.peer] < len(keys)
                and self._next[op.peer] <= want + self.lookahead
                and self._outstanding[op.peer] <= self.lookahead
            ):
                self._post_next(op.peer, keys)
        return self._posted.pop((op.key, op.peer))

    def _tagged(self, op: Op) -> tuple[object, torch.Tensor]:
        """Tagged: `op`'s receive, and the next `lookahead` of the program's posted with it."""
        last = min(self._at[(op.key, op.peer)] + self.lookahead, len(self._receives) - 1)
        while self._ahead <= last:
            ahead = self._receives[self._ahead]
            with naming_peer(self.rank, ahead, "could not post the receive for"):
                self._posted[(ahead.key, ahead.peer)] = self._post_tagged(ahead)
            self._ahead += 1
        most = self.max_posted_ahead
        most[op.peer] = max(most.get(op.peer, 0), self._outstanding[op.peer])
        return self._posted.pop((op.key, op.peer))

    def _post_tagged(self, op: Op) -> tuple[object, torch.Tensor]:
        buf = torch.empty(self.shape_of(op.key), dtype=self.dtype, device=self.device)
        self._outstanding[op.peer] += 1
        return dist.irecv(buf, op.peer, tag=op.tag), buf

    def arrived(self, op: Op) -> None:
        """`op`'s message has been waited for: one fewer outstanding from its sender."""
        self._outstanding[op.peer] -= 1

    def _post_next(self, src: int, keys: list[str]) -> None:
        key = keys[self._next[src]]
        buf = torch.empty(self.shape_of(key), dtype=self.dtype, device=self.device)
        work = dist.irecv(buf, src, group=self.ordered[1][(src, self.rank)], tag=0)
        self._posted[(key, src)] = (work, buf)
        self._next[src] += 1
        self._outstanding[src] += 1
        most = self.max_posted_ahead
        most[src] = max(most.get(src, 0), self._outstanding[src])

    def wait(self, work, op: Op) -> None:
        """Wait for a message: on NCCL the process group's timeout applies (a timed-out wait
        raises); on gloo our own host timeout. Either way a failure names rank, op and peer."""
        with naming_peer(self.rank, op, "failed while waiting for"):
            ok = work.wait() if self.device.type == "cuda" else work.wait(self.timeout)
        if ok is False:
            raise PeerFailure(
                f"rank {self.rank}: timed out after {self.timeout.total_seconds():.0f}"
                f" s waiting for {op} (peer rank {op.peer})"
            )
