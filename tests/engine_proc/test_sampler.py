import pytest
import torch

from engine_proc.sampler import Sampler, SamplingBatch
from tests.tolerance import tolerance

pytestmark = pytest.mark.numeric

# log-softmax over a row of 50 logits ~ N(0, 1): its log-sum-exp sums 50 terms (the sampler's
# and the reference's rows differ in shape, masking and so in kernel path)
LOG_SOFTMAX_BOUND = tolerance(torch.float32, 50, scale=1.0)


def sample(logits, params):
    return Sampler()(logits, params)[0]


def make_params(n, temperature=1.0, top_p=1.0, top_k=None, seeds=None, vocab=50):
    temps = torch.full((n,), float(temperature))
    greedy = temps == 0
    generators = [
        None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * n)
    ]
    top_ks = torch.full((n,), vocab if top_k is None else top_k, dtype=torch.int64)
    return SamplingBatch(
        temperatures=torch.where(greedy, torch.ones_like(temps), temps),
        top_ps=torch.full((n,), float(top_p)),
        top_ks=top_ks,
        greedy=greedy,
        generators=generators,
        all_greedy=bool(greedy.all()),
        any_top_p=top_p < 1.0,
        any_top_k=top_k is not None,
        any_seeded=any(g is not None for g in generators),
    )


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    out = sample(logits, make_params(4, temperature=0.0))
    assert torch.equal(out, logits.argmax(-1))


def test_mixed_greedy_and_sampled_rows():
    logits = torch.randn(2, 50)
    params = make_params(2, temperature=1.0)
    params.greedy = torch.tensor([True, False])
    params.all_greedy = False
    for _ in range(20):
        assert sample(logits, params)[0] == logits[0].argmax()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(8, 50)
    assert torch.equal(sample(logits, make_params(8, top_k=1)), logits.argmax(-1))
    assert torch.equal(sample(logits, make_params(8, top_p=1e-6)), logits.argmax(-1))


def test_top_k_restricts_support():
    torch.manual_seed(0)
    logits = torch.randn(1, 50).repeat(2000, 1)
    out = sample(logits, make_params(2000, temperature=5.0, top_k=3))
    assert set(out.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_top_p_restricts_support():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(2000, 1)
    out = sample(logits, make_params(2000, top_p=0.7, vocab=4))
    assert set(out.tolist()) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    out = sample(probs.log().repeat(20000, 1), make_params(20000, vocab=3))
    freq = torch.bincount(out, minlength=3).float() / 20000
    # a frequency of 20,000 draws has std sqrt(p (1 - p) / 20000) <= 0.0035: 0.02 is 5.7 std
    assert (freq - probs).abs().max() < 0.02


def test_seeded_rows_do_not_depend_on_batch_mates():
    logits = torch.randn(3, 50)
    alone = [sample(logits[1:2], make_params(1, seeds=[42])).item() for _ in range(1)]
    seqs = []
    for _ in range(2):
        params = make_params(3, seeds=[None, 42, 7])
        seqs.append(sample(logits, params).tolist())
    assert seqs[0][1] == seqs[1][1] == alone[0]
    assert seqs[0][2] == seqs[1][2]


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    a = [sample(logits, make_params(1, seeds=[s])).item() for s in range(10)]
    assert len(set(a)) > 5


def test_logprobs_are_of_the_distribution_sampled():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = make_params(3, temperature=0.0)
    params.logprob_rows = torch.tensor([0, 2])
    params.max_logprobs = 4
    ids, lp = Sampler()(logits, params)
    want = torch.log_softmax(logits, -1)
    assert torch.equal(lp.rows, torch.tensor([0, 2]))
    torch.testing.assert_close(lp.sampled, want[[0, 2], ids[[0, 2]]], **LOG_SOFTMAX_BOUND)
    assert torch.equal(lp.top_ids[:, 0], ids[[0, 2]])  # greedy: the token is the top one
    torch.testing.assert_close(lp.top_values, want[[0, 2]].topk(4).values, **LOG_SOFTMAX_BOUND)
    # sampled rows: after temperature, with the top-k cut at -inf
    params = make_params(1, temperature=2.0, top_k=3)
    params.logprob_rows = torch.tensor([0])
    params.max_logprobs = 5
    ids, lp = Sampler()(logits[:1], params)
    scaled = logits[0] / 2.0
    kept = scaled.topk(3)
    want = torch.full_like(scaled, -float("inf"))
    want[kept.indices] = torch.log_softmax(kept.values, -1)
    assert ids[0] in kept.indices
    torch.testing.assert_close(lp.top_values[0, :3], want.topk(3).values, **LOG_SOFTMAX_BOUND)
    assert torch.isinf(lp.top_values[0, 3:]).all()
    assert Sampler()(logits, make_params(3))[1] is None
