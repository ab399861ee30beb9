"""Coreset mini-batch selection (DESIGN 2.3): from a pool of r x B examples pick B whose gradient
acts like the pool's.

1. Sources with fewer pool examples than the mean per source are kept whole.
2. The rest of the budget goes to the big sources in proportion to their pool counts.
3. Each big-source example gets a low-dimensional gradient feature on a small last-layer
   parameter block: zeroth-order (derivatives along k fresh random directions, by two-sided
   perturbation replaying only the last layer, no autograd, or in closed form where the replay
   has one) or exact (per-example gradient of the block).
4. Features are normalised with the selector's own Adam-style running moments, then sparsified
   to the top-h coordinates by |mean of the source's normalised features|.
5. Per source, greedy facility location with l1 distance picks the examples (lazy greedy,
   vectorised in torch, on the features' device).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_mllm.errors import ConfigError

# loss(hidden [n, ...], targets [n, ...], block) -> per-example loss [n]
LastLayerLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


MAX_POOL_RATIO = 64.0


@dataclass(frozen=True)
class CoresetConfig:
    """How the selector works. `batch_size` is B; the pool holds `pool_ratio` x B examples."""

    batch_size: int
    pool_ratio: float = 2.0
    features: str = "zo"  # "zo" (zeroth-order) or "exact"
    num_directions: int = 16  # k, zeroth-order only
    epsilon: float = 1e-3  # zeroth-order perturbation size
    top_h: int = 32  # coordinates kept per source after normalisation
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"coreset batch size {self.batch_size} must be at least 1")
        if not 1 <= self.pool_ratio <= MAX_POOL_RATIO:  # also refuses NaN
            raise ConfigError(
                f"--coreset-pool-ratio {self.pool_ratio} must be between 1 and "
                f"{MAX_POOL_RATIO} (the pool holds ratio x B examples and goes forward whole)"
            )
        if self.features not in ("zo", "exact"):
            raise ConfigError(f"--coreset-features {self.features!r}: use zo or exact")
        if self.features == "zo" and self.num_directions < 16:
            raise ConfigError(
                f"{self.num_directions} zeroth-order directions; use at least 16 "
                "(fewer makes the selection close to one-dimensional)"
            )

    @property
    def pool_size(self) -> int:
        return int(round(self.pool_ratio * self.batch_size))


def source_budgets(
    source_ids: torch.Tensor, batch_size: int, keep_small: bool = True
) -> dict[int, int]:
    """How many examples each source keeps: small sources (fewer pool examples than the mean per
    source) whole, the rest in proportion to their counts; `keep_small=False`: every source in
    proportion (the ablation)."""
    if source_ids.numel() < batch_size:
        raise ConfigError(
            f"pool of {source_ids.numel()} examples is smaller than the batch "
            f"{batch_size}; the pool must hold at least B examples"
        )
    if (source_ids < 0).any():
        raise ConfigError("every pool example needs a source id >= 0")
    ids, counts = torch.unique(source_ids, return_counts=True)
    counts_of = {int(i): int(c) for i, c in zip(ids, counts, strict=True)}
    mean = source_ids.numel() / len(counts_of)
    small = {s: c for s, c in counts_of.items() if c < mean and keep_small}
    if sum(small.values()) > batch_size:  # too many small sources to keep them all whole
        small = {}
    budgets = dict(small)
    big = {s: c for s, c in counts_of.items() if s not in small}
    left = batch_size - sum(small.values())
    total = sum(big.values())
    shares = {s: left * c / total for s, c in big.items()}
    for s in big:
        budgets[s] = min(big[s], int(shares[s]))
    # Largest remainders get the leftover slots (never above a source's count).
    rest = batch_size - sum(budgets.values())
    for s in sorted(big, key=lambda s: (-(shares[s] - int(shares[s])), s)):
        if rest == 0:
            break
        if budgets[s] < big[s]:
            budgets[s] += 1
            rest -= 1
    return budgets


def facility_location(features: torch.Tensor, k: int) -> list[int]:
    """Greedy facility location with l1 distances: k indices maximising
    sum_i max_{j in S} (d_max - |x_i - x_j|_1). Lazy greedy: a candidate's gain only shrinks,
    so stale upper bounds are re-evaluated (in vectorised batches) only while they could win.
    Ties go to the lowest index, as in `facility_location_brute_force`."""
    n = features.shape[0]
    if k >= n:
        return list(range(n))
    dist = torch.cdist(features, features, p=1)
    sim = dist.max() - dist  # [i, j]: how well j represents i
    best = torch.zeros(n, dtype=sim.dtype, device=sim.device)
    bound = (sim - best[:, None]).clamp(min=0).sum(0)  # exact gains at the start
    fresh = torch.ones(n, dtype=torch.bool, device=sim.device)
    chosen: list[int] = []
    taken = torch.zeros(n, dtype=torch.bool, device=sim.device)
    while len(chosen) < k:
        masked = bound.masked_fill(taken, -float("inf"))
        top = int(torch.argmax(masked))  # first index among equal bounds
        if bool(fresh[top]):
            chosen.append(top)
            taken[top] = True
            best = torch.maximum(best, sim[:, top])
            fresh[:] = False
            continue
        # Re-evaluate every stale candidate whose bound ties or beats the leader's.
        cand = (~taken) & (~fresh) & (masked >= masked[top])
        idx = cand.nonzero().squeeze(1)
        bound[idx] = (sim[:, idx] - best[:, None]).clamp(min=0).sum(0)
        fresh[idx] = True
    return chosen


def facility_location_brute_force(features: torch.Tensor, k: int) -> list[int]:
    """Plain greedy (every gain every round); the reference the lazy one must equal."""
    n = features.shape[0]
    if k >= n:
        return list(range(n))
    dist = torch.cdist(features, features, p=1)
    sim = dist.max() - dist
    best = torch.zeros(n, dtype=sim.dtype)
    chosen: list[int] = []
    for _ in range(k):
        gains = (sim - best[:, None]).clamp(min=0).sum(0)
        gains[chosen] = -float("inf")
        j = int(torch.argmax(gains))
        chosen.append(j)
        best = torch.maximum(best, sim[:, j])
    return chosen


class LossReplay:
    """A last-layer loss `loss(hidden, targets, block) -> [n]` replayed for features: losses for
    a batch of blocks by vmap, exact per-example gradients by vmap(grad), directions of the
    block's own shape. (`sampler.VocabParallelReplay` is the same interface under TP.)"""

    def __init__(self, loss: LastLayerLoss) -> None:
        self.loss = loss

    def losses(self, hidden: torch.Tensor, targets, blocks: torch.Tensor) -> torch.Tensor:
        """[K, n]: every example's loss under each of the K blocks."""
        from torch.func import vmap

        return vmap(self.loss, in_dims=(None, None, 0))(hidden, targets, blocks)

    def gradients(self, hidden: torch.Tensor, targets, block: torch.Tensor) -> torch.Tensor:
        """[n, block.numel()]: per-example gradients of the loss with respect to `block`."""
        from torch.func import grad, vmap

        def one(h, t, b):
            return self.loss(h.unsqueeze(0), t.unsqueeze(0), b).sum()

        g = vmap(grad(one, argnums=2), in_dims=(0, 0, None))(hidden, targets, block.detach())
        return g.reshape(hidden.shape[0], -1)

    def directions(self, k: int, block: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """[k, *block.shape] standard normal directions from `generator` (on the host)."""
        shape = (k, *block.shape)
        return torch.randn(shape, generator=generator, dtype=block.dtype, device="cpu")


@torch.no_grad()
def zeroth_order_features(
    replay,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    block: torch.Tensor,
    num_directions: int,
    epsilon: float,
    generator: torch.Generator,
    chunk: int = 4,
) -> torch.Tensor:
    """[n, k] directional derivatives of each example's loss along k fresh random directions,
    by two-sided perturbation of `block` (only the last layer is replayed; no autograd). The
    directions go `chunk` at a time, each chunk's 2 x chunk perturbed blocks evaluated together
    (`replay.losses`), so the replay's memory is a chunk's, not k's. A replay with a closed
    form (`projected_gradients`: the MLLM's softmax output layer) gives the derivatives the
    perturbation approximates, along the same directions, for one replay's compute instead of
    2 x k (k / chunk where the examples' gradients do not fit in a chunk's memory)."""
    if hasattr(replay, "projected_gradients"):
        z = (replay.directions(min(chunk, num_directions - s), block, generator)
             for s in range(0, num_directions, chunk))  # fmt: skip
        return replay.projected_gradients(hidden, targets, block, z)
    out = []
    for start in range(0, num_directions, chunk):
        c = min(chunk, num_directions - start)
        z = replay.directions(c, block, generator).to(block.device)
        losses = replay.losses(
            hidden, targets, torch.cat([block + epsilon * z, block - epsilon * z])
        )
        out.append((losses[:c] - losses[c:]) / (2 * epsilon))  # [c, n]
    return torch.cat(out).T


def exact_features(
    loss: LastLayerLoss, hidden: torch.Tensor, targets: torch.Tensor, block: torch.Tensor
) -> torch.Tensor:
    """[n, block.numel()] per-example gradients of the loss with respect to `block`."""
    return LossReplay(loss).gradients(hidden, targets, block)


class CoresetSelector:
    """Stateful selection: running feature moments and the direction RNG are its state, so a
    resumed run (`load_state_dict`) selects exactly what an uninterrupted one would."""

    def __init__(self, config: CoresetConfig) -> None:
        self.config = config
        self.generator = torch.Generator().manual_seed(config.seed)
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.t = 0

    def features(self, loss, hidden: torch.Tensor, targets, block: torch.Tensor) -> torch.Tensor:
        """Each example's feature row; `loss` is a LastLayerLoss or a replay (`LossReplay`,
        `sampler.VocabParallelReplay`)."""
        c = self.config
        replay = loss if hasattr(loss, "losses") else LossReplay(loss)
        if c.features == "zo":
            return zeroth_order_features(
                replay, hidden, targets, block, c.num_directions, c.epsilon, self.generator
            )
        return replay.gradients(hidden, targets, block)

    def normalise(self, feats: torch.Tensor) -> torch.Tensor:
        """Adam-style: divide by the bias-corrected running RMS of each coordinate."""
        c = self.config
        mean, sq = feats.mean(0), feats.pow(2).mean(0)
        if self.m is None or self.m.shape != mean.shape:
            self.m, self.v, self.t = torch.zeros_like(mean), torch.zeros_like(sq), 0
        self.t += 1
        self.m = c.beta1 * self.m + (1 - c.beta1) * mean
        self.v = c.beta2 * self.v + (1 - c.beta2) * sq
        v_hat = self.v / (1 - c.beta2**self.t)
        return feats / (v_hat.sqrt() + c.adam_eps)

    def scored_rows(self, source_ids: torch.Tensor) -> torch.Tensor:
        """Pool rows selected among (sources with more pool rows than their budget), source by
        source: only these need the pool's forward and features; the others are kept whole."""
        _, rows, big = self._by_source(source_ids)
        return torch.cat([rows[s] for s in big]) if big else torch.empty(0, dtype=torch.long)

    def budgets(self, source_ids: torch.Tensor) -> dict[int, int]:
        """How many pool examples of each source to keep (`source_budgets`)."""
        return source_budgets(source_ids, self.config.batch_size)

    def _by_source(self, source_ids: torch.Tensor) -> tuple[dict, dict, list[int]]:
        """(budgets, each source's pool rows, the sources selected among, in budget order)."""
        budgets = self.budgets(source_ids)
        rows = {s: (source_ids == s).nonzero().flatten() for s in budgets}
        return budgets, rows, [s for s, b in budgets.items() if b < len(rows[s])]

    def select(
        self,
        source_ids: torch.Tensor,
        loss: LastLayerLoss,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        block: torch.Tensor,
    ) -> torch.Tensor:
        """Indices (into the pool) of the B chosen examples, sorted; `hidden` and `targets`
        for every pool row."""
        rows = self.scored_rows(source_ids).to(hidden.device)
        return self.select_scored(source_ids, loss, hidden[rows], targets[rows], block)

    def select_scored(
        self,
        source_ids: torch.Tensor,
        loss: LastLayerLoss,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        block: torch.Tensor,
    ) -> torch.Tensor:
        """As `select`, with `hidden` and `targets` only for `scored_rows(source_ids)`."""
        c = self.config
        budgets, rows, big = self._by_source(source_ids)
        chosen = [i for s in budgets if s not in big for i in rows[s].tolist()]
        if big:
            feats = self.normalise(self.features(loss, hidden, targets, block))
            start = 0
            for s in big:
                f = feats[start : start + len(rows[s])]
                start += len(rows[s])
                h = min(c.top_h, f.shape[1])
                keep = f.mean(0).abs().topk(h).indices
                picked = facility_location(f[:, keep], budgets[s])
                chosen += rows[s][picked].tolist()
        return torch.tensor(sorted(chosen), dtype=torch.long, device="cpu")  # host indices

    def state_dict(self) -> dict:
        return {
            "generator": self.generator.get_state(),
            "m": self.m,
            "v": self.v,
            "t": self.t,
            "config": dataclasses.asdict(self.config),  # plain data: checkpoints load no class
        }

    def load_state_dict(self, state: dict) -> None:
        if state["config"] != dataclasses.asdict(self.config):
            raise ConfigError(
                "coreset state was saved with a different configuration "
                f"({state['config']}); resume with the same --coreset-* options"
            )
        self.generator.set_state(state["generator"])
        self.m, self.v, self.t = state["m"], state["v"], state["t"]


def resolve_block(model: torch.nn.Module, name: str, rows: int | None = None) -> torch.Tensor:
    """The parameter `name` of `model` (its first `rows` rows), as the feature block."""
    params = dict(model.named_parameters())
    if name not in params:
        last = [n for n in params if n.endswith(".weight")][-3:]
        raise ConfigError(
            f"feature block '{name}' is not a parameter of the model; "
            f"last-layer candidates: {', '.join(last)}"
        )
    p = params[name]
    return p if rows is None else p[:rows]
