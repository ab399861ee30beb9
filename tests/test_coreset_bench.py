"""The coreset benchmark's parts: paired intervals, the skewed mixture's source sizes, the
selection's per-source budgets on an imbalanced pool, and scoring only the rows selected among."""

import math

import bench_coreset
import pytest
import torch
from bench_data.mixture import SKEWED_SOURCES, build_mixture
from paired_stats import paired_interval

from megatron_mllm.data.coreset import CoresetConfig, CoresetSelector, LossReplay, source_budgets


def test_paired_interval_on_a_fixed_input():
    a, b = [1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 0.0, 0.0, 0.0, 0.0]
    c = paired_interval(a, b)
    # mean 3, sd sqrt(2.5), t(0.975, 4) = 2.7764451
    half = 2.7764451 * math.sqrt(2.5) / math.sqrt(5)
    assert (c.mean, c.n) == (3.0, 5)
    assert c.low == pytest.approx(3 - half, abs=1e-6) and c.high == pytest.approx(
        3 + half, abs=1e-6
    )
    assert c.excludes_zero()
    # Pairing: a shared per-seed offset cancels; the other order flips the sign.
    shifted = paired_interval([x + 10 * i for i, x in enumerate(a)], [10.0 * i for i in range(5)])
    assert shifted.low == pytest.approx(c.low) and shifted.high == pytest.approx(c.high)
    back = paired_interval(b, a)
    assert (back.low, back.high) == pytest.approx((-c.high, -c.low))
    noisy = paired_interval([1.0, -1.0, 2.0, -2.0], [0.0] * 4)
    assert not noisy.excludes_zero() and noisy.text(2) == "+0.00+-2.91"  # sd sqrt(10/3), t(3) 3.182
    assert math.isnan(paired_interval([1.0], [0.0]).low)
    with pytest.raises(ValueError, match="equal"):
        paired_interval([1.0], [1.0, 2.0])


def test_paired_interval_agrees_with_scipys_paired_t_test():
    from scipy.stats import ttest_rel

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(10, generator=g).tolist(), torch.randn(10, generator=g).tolist()
    ours = paired_interval(a, b)
    theirs = ttest_rel(a, b).confidence_interval(0.95)
    assert (ours.low, ours.high) == pytest.approx((theirs.low, theirs.high))


def _row(loss: float, sources: list[float], acc: float = 0.5) -> dict:
    return {"heldout_loss": loss, "heldout_accuracy": acc, "source_loss": sources,
            "source_accuracy": [acc] * len(sources), "step_s": 0.1,
            "peak_activation_bytes": 1, "curve": [(1.0, loss)]}  # fmt: skip


def test_summary_pairs_methods_seed_by_seed_overall_and_per_source():
    results = {
        "random_B": [_row(2.0, [1.0, 3.0]), _row(3.0, [2.0, 4.0]), _row(4.0, [3.0, 5.0])],
        "stratified_B": [_row(1.9, [1.0, 2.8]), _row(2.9, [2.0, 3.8]), _row(3.9, [3.0, 4.8])],
        "2B_accumulation": [_row(1.5, [1, 2]), _row(2.5, [2, 3]), _row(3.6, [3, 4.2])],
        "coreset_zo": [_row(1.5, [1.0, 2.0]), _row(2.5, [2.1, 2.9]), _row(3.5, [3.0, 4.0])],
    }
    s = bench_coreset.summarise(results)
    vs = s["coreset_zo"]["vs"]
    assert vs["random_B"]["heldout_loss"].mean == pytest.approx(-0.5)
    assert vs["random_B"]["heldout_loss"].half == pytest.approx(0.0, abs=1e-12)  # same every seed
    assert vs["stratified_B"]["heldout_loss"].mean == pytest.approx(-0.4)
    per = vs["random_B"]["source_loss"]
    assert [p.mean for p in per] == pytest.approx([0.1 / 3, -1.0 - 0.1 / 3])
    assert "coreset_zo" not in vs and s["coreset_zo"]["heldout_loss"] == pytest.approx(2.5)
    assert s["random_B"]["source_loss"] == pytest.approx([2.0, 4.0])
    assert s["coreset_zo"]["reached"] == 3  # final loss at or below accumulation's each seed


def test_the_skewed_mixture_has_the_stated_source_sizes():
    train, held = build_mixture(4000, seed=0, seq_len=16, sources=SKEWED_SOURCES)
    counts = torch.bincount(train.source).tolist()
    assert counts == [round(share * 4000) for share in SKEWED_SOURCES.values()]
    assert counts[0] >= 20 * counts[-1]  # sizes spread over at least 20x
    assert torch.bincount(held.source).tolist() == [64] * len(SKEWED_SOURCES)
    assert train.answer_mask.any(1).all() and held.answer_mask.any(1).all()


def test_budgets_on_an_imbalanced_pool_keep_small_sources_and_split_the_rest():
    # A pool of 32: one big source (20), six small ones (5, 3, 2, 1, 1 and 0 + absent).
    ids = torch.tensor([0] * 20 + [1] * 5 + [2] * 3 + [3] * 2 + [4] + [5])
    budgets = source_budgets(ids, 16)
    # mean per source 32 / 6 = 5.33: sources 1-5 (12 examples) kept whole, 4 left for source 0
    assert budgets == {1: 5, 2: 3, 3: 2, 4: 1, 5: 1, 0: 4}
    proportional = source_budgets(ids, 16, keep_small=False)
    assert sum(proportional.values()) == 16 and proportional[0] == 10
    assert all(proportional[s] <= int((ids == s).sum()) for s in proportional)


def test_selection_takes_each_sources_budget_and_scores_only_the_big_sources():
    ids = torch.tensor([0] * 20 + [1] * 5 + [2] * 3 + [3] * 2 + [4] + [5])
    g = torch.Generator().manual_seed(1)
    hidden, targets = torch.randn(32, 8, generator=g), torch.randint(0, 5, (32,), generator=g)
    block = torch.randn(5, 8, generator=g)

    def loss(h, t, w):
        return torch.nn.functional.cross_entropy(h @ w.T, t, reduction="none")

    config = CoresetConfig(batch_size=16, features="exact")
    selector = CoresetSelector(config)
    scored = selector.scored_rows(ids)
    assert scored.tolist() == list(range(20))  # only the big source needs features
    picked = selector.select(ids, LossReplay(loss), hidden, targets, block)
    assert torch.bincount(ids[picked], minlength=6).tolist() == [4, 5, 3, 2, 1, 1]
    again = CoresetSelector(config).select_scored(
        ids, LossReplay(loss), hidden[scored], targets[scored], block
    )
    assert torch.equal(picked, again)  # the pool's other rows never enter the selection


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--methods", "random_B,bogus"], "--methods: unknown bogus"),
        (["--methods", "random_B,2B_accumulation"], "must include coreset_zo"),
        (["--workers", "3", "--seeds", "2"], "--workers 3 must be between 1 and --seeds (2)"),
        (["--pipeline-runs", "coreset,Bogus"], "--pipeline-runs: unknown Bogus"),
        (["--pipeline-runs", "B,coreset"], "must hold coreset and at least one coreset_lookahead"),
    ],
)
def test_bad_benchmark_arguments_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_coreset.parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and says in err and len(err.strip().splitlines()) == 1


def test_quick_is_a_short_check_of_the_four_methods_the_targets_compare():
    args = bench_coreset.parse_args(["--quick"])
    assert (args.seeds, args.steps, args.lr) == (3, 200, 1e-3)
    assert args.methods == ["random_B", "stratified_B", "2B_accumulation", "coreset_zo"]
    assert bench_coreset.parse_args([]).seeds == 10


def test_pipeline_only_run_writes_its_json_out(tmp_path, monkeypatch, capsys):
    """--skip-quality with --json-out writes the pipeline's section there (not silently
    ignored); the pipeline comparison itself is stubbed here (it is a benchmark)."""
    import json

    import coreset_pipeline

    section = {"runs": {}, "lookahead_vs_coreset": {}, "repeats": 1}
    monkeypatch.setattr(coreset_pipeline, "pipeline_section", lambda args: section)
    monkeypatch.setattr(coreset_pipeline, "print_pipeline", lambda p: print("table"))
    out = tmp_path / "pipe.json"
    argv = ["--skip-quality", "--pipeline-steps", "1", "--json-out", str(out)]
    assert bench_coreset.main(argv) == 0
    assert json.loads(out.read_text()) == {"pipeline": section}
    assert capsys.readouterr().out.strip() == "table"


def test_pipeline_ratio_interval_is_the_paired_log_interval():
    """The look-ahead's ratio over every measured step: the geometric mean of the paired
    ratios with the 95% interval of the paired log differences (a constant ratio: no width)."""
    import math

    from coreset_pipeline import ratio_interval

    b = [1.0, 2.0, 0.5, 4.0]
    assert ratio_interval([math.log(0.9 * x) for x in b], [math.log(x) for x in b]) == (
        pytest.approx(0.9),
        pytest.approx(0.9),
        pytest.approx(0.9),
    )
    geo, low, high = ratio_interval([math.log(x) for x in (0.8, 1.0, 0.9)], [0.0, 0.0, 0.0])
    assert geo == pytest.approx((0.8 * 1.0 * 0.9) ** (1 / 3)) and low < geo < high


def test_pipeline_top_waits_are_means_per_step_longest_first():
    """A rank's longest waits: each message's mean seconds per step (a step that did not wait
    for it counts 0), the longest first, at most `keep`."""
    from coreset_pipeline import top_waits

    steps = [{"RECV:a": 0.3, "RECV:b": 0.1}, {"RECV:b": 0.3}, {"RECV:c": 0.05}]
    assert top_waits(steps, keep=2) == {
        "RECV:b": pytest.approx(0.4 / 3),
        "RECV:a": pytest.approx(0.1),
    }
