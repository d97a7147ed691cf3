"""Selection: nothing dropped or double counted; flat == hierarchical when fully expanded;
the fast path makes the same decisions as the serial float64 path."""

from dataclasses import replace

import pytest
import torch

from longattn.sparse import SCSALayer
from longattn.sparse.kernel import NEG_INF, stop_counts
from longattn.sparse.experimental.tree import build_tree, similarity_order
from sparse_fixtures import attn_case, small_cfg as _small_cfg

H, HKV, D, N = 6, 2, 32, 1203


def small_cfg(**kw):
    return _small_cfg(**{"tree_fanout": 3, **kw})


@pytest.fixture(scope="module")
def case():
    return attn_case(N, H, HKV, D, seed=5, queries=3, query_seed=2, centers=24)


@pytest.mark.parametrize("hierarchical, outliers, refine, probe",
                         [(False, 0, 0, 0), (True, 0, 0, 0), (False, 4, 0, 0), (True, 4, 0, 0), (False, 4, 2, 0),
                          (False, 4, 0, 4)])
@pytest.mark.parametrize("tau", [0.0, 0.003, 0.03, 0.3, 1.0])
def test_every_key_counted_exactly_once(case, hierarchical, outliers, refine, probe, tau):
    qs, k, v, scale = case
    layer = SCSALayer(small_cfg(hierarchical=hierarchical, tau_default=tau, outliers=outliers, refine=refine,
                                probe_dims=probe), H, HKV, D)
    before = dict(layer.counters)
    for q in qs:
        layer.attend(q, k, v, scale)
        (acc,) = layer.debug_accounting()
        assert torch.equal(acc["coverage"], torch.ones(HKV, N, dtype=torch.int64))
        assert torch.equal(acc["exact_rows"] + acc["opened_rows"] + acc["tail_rows"], acc["n"])
        assert bool((acc["role"] >= 0).all())
        assert torch.equal((acc["role"] == 1).sum(1), acc["opened_rows"])
        if tau == 0.0:
            assert int(acc["tail_rows"].sum()) == 0
        if tau == 1.0 and not probe:
            assert int(acc["opened_rows"].sum()) == 0
    assert layer.counters["calls"] - before["calls"] == len(qs)
    assert layer.counters["rebuilds"] == 1
    assert layer.counters["exact_rows"] + layer.counters["opened_rows"] <= len(qs) * HKV * N


def test_accounting_with_partial_clusters_and_batch(case):
    qs, k, v, scale = case
    kb, vb = torch.cat([k, k.flip(2)]), torch.cat([v, v.flip(2)])  # two different rows
    layer = SCSALayer(small_cfg(cluster_size=24, tau_default=0.02), H, HKV, D)
    layer.attend(torch.cat([qs[0], qs[1]]), kb, vb, scale)
    accs = layer.debug_accounting()
    assert len(accs) == 2
    for acc in accs:
        assert torch.equal(acc["coverage"], torch.ones(HKV, N, dtype=torch.int64))


@pytest.mark.parametrize("tree_order", ["similar", "cache"])
@pytest.mark.parametrize("tau", [0.0, 1e-9])
def test_flat_and_hierarchical_agree_when_fully_expanded(case, tau, tree_order):
    qs, k, v, scale = case
    # the PyTorch flat path: the same ops as the walk's (the C++ one is checked in test_sparse_native)
    flat = SCSALayer(small_cfg(tau_default=tau, native=False), H, HKV, D)
    tree = SCSALayer(small_cfg(tau_default=tau, hierarchical=True, tree_order=tree_order), H, HKV, D)
    for q in qs:
        a, b = flat.attend(q, k, v, scale), tree.attend(q, k, v, scale)
        (fa,), (ta,) = flat._last, tree._last
        M = flat.indexes[0].num_clusters
        assert torch.equal(fa[1].opened, ta[1].opened)
        assert bool(fa[1].opened.all()) and fa[1].opened.shape == (HKV, M)
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    # Walking the whole tree scores every node once: M leaves plus the internal nodes.
    assert tree.counters["clusters_scored"] == len(qs) * HKV * tree.indexes[0].tree.num_nodes
    assert flat.counters["clusters_scored"] == len(qs) * HKV * M


@pytest.mark.parametrize("packing", ["f32", "q8_0"])
@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("tau, outliers", [(0.01, 0), (0.1, 0), (0.01, 3)])
def test_fast_path_matches_serial_reference(case, packing, hierarchical, tau, outliers):
    qs, k, v, scale = case
    kw = dict(packing=packing, hierarchical=hierarchical, tau_default=tau, outliers=outliers)
    fast = SCSALayer(small_cfg(**kw), H, HKV, D)
    slow = SCSALayer(small_cfg(serial=True, **kw), H, HKV, D)
    for q in qs[:2]:
        a, b = fast.attend(q, k, v, scale), slow.attend(q, k, v, scale)
        assert torch.equal(fast._last[0][1].opened, slow._last[0][1].opened)
        assert 0 < int(fast._last[0][1].opened.sum()) < fast._last[0][1].opened.numel()
        assert (a.double() - b.double()).abs().max().item() < 2e-5 * v.abs().max().item()
    assert fast.counters == slow.counters


@pytest.mark.parametrize("packing", ["f32", "q8_0"])
@pytest.mark.parametrize("tau, outliers", [(0.01, 0), (0.1, 0), (0.1, 3)])
def test_refined_rule_matches_serial_reference(case, packing, tau, outliers):
    """refine: the PyTorch path re-decides as the float64 path does, only ever opening more."""
    kw = dict(packing=packing, tau_default=tau, outliers=outliers)
    # the re-decision opened more somewhere, or this case tests nothing
    assert _more_than_the_single_decision(case, small_cfg(refine=2, **kw), small_cfg(**kw)) > 0


def _more_than_the_single_decision(case, cfg, single_cfg) -> int:
    """Runs ``cfg`` on the PyTorch path and the float64 path, and ``single_cfg`` (the stop rule's
    single decision) beside them: the paths open the same clusters and give outputs within the
    fp32 bound, ``cfg`` never opens fewer than the single decision. Returns how many more it
    opened over the case's queries."""
    qs, k, v, scale = case
    fast = SCSALayer(cfg, H, HKV, D)
    slow = SCSALayer(replace(cfg, serial=True), H, HKV, D)
    once = SCSALayer(single_cfg, H, HKV, D)
    grew = 0
    for q in qs:
        a, b = fast.attend(q, k, v, scale), slow.attend(q, k, v, scale)
        once.attend(q, k, v, scale)
        opened, single = fast._last[0][1].opened, once._last[0][1].opened
        assert torch.equal(opened, slow._last[0][1].opened)
        assert not bool((single & ~opened).any())
        grew += int(opened.sum()) - int(single.sum())
        assert (a.double() - b.double()).abs().max().item() < 2e-5 * v.abs().max().item()
    assert fast.counters == slow.counters
    return grew


@pytest.mark.parametrize("packing", ["f32", "q8_0"])
@pytest.mark.parametrize("dims, keys, refine", [(4, 1, 0), (4, 3, 0), (D, 2, 0), (4, 3, 2)])
def test_probe_matches_serial_reference(case, packing, dims, keys, refine):
    """probe: the PyTorch path picks the clusters the float64 path picks, on top of the stop
    rule's single decision (never fewer; refine then re-decides from the union), and opens more
    somewhere."""
    kw = dict(packing=packing, tau_default=0.5, outliers=3)
    cfg = small_cfg(probe_dims=dims, probe_keys=keys, refine=refine, **kw)
    assert _more_than_the_single_decision(case, cfg, small_cfg(**kw)) > 0


def test_probe_over_every_dimension_opens_each_heads_top_keys(case):
    """With every dimension scored (f32 packing) the probe's score is q.k: the clusters it opens
    are exactly those holding each query head's best member keys, found here by brute force."""
    qs, k, v, scale = case
    keys = 3
    layer = SCSALayer(small_cfg(packing="f32", probe_dims=D, probe_keys=keys, tau_default=1.0), H, HKV, D)
    g = H // HKV
    for q in qs:
        layer.attend(q, k, v, scale)
        index, opened = layer.indexes[0], layer._last[0][1].opened
        M = index.num_clusters
        want = torch.zeros_like(opened)
        for h in range(HKV):
            slots = index.slots[h, :M]  # [M, cs], -1 padding
            cluster = torch.arange(M).unsqueeze(1).expand_as(slots)[slots >= 0]
            s = q[0, h * g:(h + 1) * g, 0].float() @ k[0, h, slots[slots >= 0]].float().T  # [g, members]
            for j in range(g):
                want[h, cluster[s[j].topk(keys).indices]] = True
        assert torch.equal(opened, want)  # tau 1 opens nothing by the rule: only the probe's
        assert 0 < int(opened.sum()) <= HKV * g * keys


@pytest.mark.parametrize("tau", [0.003, 0.03, 0.3])
def test_refined_rule_holds_with_exact_masses(case, tau):
    """Refined to a fixed point, each query head's unopened estimated mass is below tau times the
    total in which every opened cluster counts with its exact mass."""
    qs, k, v, scale = case
    layer = SCSALayer(small_cfg(refine=16, tau_default=tau), H, HKV, D)
    for q in qs:
        layer.attend(q, k, v, scale)
        index, opened = layer.indexes[0], layer._last[0][1].opened  # [Hkv, M]
        prep = layer._prepare(index, q[0, :, 0], k[0], v[0], scale)
        log_mass = layer._cluster_log_mass(index, prep, torch.ones_like(opened), scale)  # [Hkv, g, M]
        o = opened.unsqueeze(1).expand_as(log_mass)
        unopened = prep.est.masked_fill(o, NEG_INF).logsumexp(-1).double()  # [Hkv, g]
        captured = torch.logaddexp(prep.log_exact, log_mass.masked_fill(~o, NEG_INF).logsumexp(-1)).double()
        holds = unopened.exp() < tau * (captured.exp() + unopened.exp())
        assert bool((holds | ~(~opened).any(1, keepdim=True)).all())
        assert 0 < int(opened.sum()) < opened.numel()


def test_tree_walk_cost_tracks_the_opened_set():
    """Focused queries open a few clusters; the walk then scores far fewer nodes than flat."""
    qs, k, v, scale = attn_case(4000, H, HKV, D, seed=9, queries=4, query_seed=1, topics=1, centers=24)
    flat = SCSALayer(small_cfg(tau_default=0.02, tree_fanout=4), H, HKV, D)
    tree = SCSALayer(small_cfg(tau_default=0.02, tree_fanout=4, hierarchical=True), H, HKV, D)
    for q in qs:
        flat.attend(q, k, v, scale)
        tree.attend(q, k, v, scale)
        (acc,) = tree.debug_accounting()
        assert torch.equal(acc["coverage"], torch.ones_like(acc["coverage"]))
    M = flat.indexes[0].num_clusters
    assert tree.counters["opened_rows"] < 0.25 * len(qs) * HKV * 4000
    assert flat.counters["clusters_scored"] == len(qs) * HKV * M
    assert tree.counters["clusters_scored"] < 0.75 * flat.counters["clusters_scored"]


def test_sparse_selection_reads_less_and_stays_close(case):
    qs, k, v, scale = case
    layer = SCSALayer(small_cfg(tau_default=0.05), H, HKV, D)
    dense = SCSALayer(small_cfg(tau_default=0.0), H, HKV, D)
    for q in qs:
        a, b = layer.attend(q, k, v, scale), dense.attend(q, k, v, scale)
        rel = (a - b).norm(dim=-1) / b.norm(dim=-1)
        assert rel.median() < 0.1
    assert layer.counters["opened_rows"] < 0.8 * dense.counters["opened_rows"]


def test_stop_rule_is_the_shortest_prefix():
    est = torch.tensor([[0.0, -1.0, -2.0, -30.0]])
    log_exact = torch.tensor([0.0])
    mass = est.exp()
    total = 1.0 + mass.sum()
    for tau in [0.0, 1e-20, 0.01, 0.05, 0.2, 0.5, 0.9, 1.0]:
        k = int(stop_counts(est, log_exact, torch.tensor([tau]))[0])
        assert k == 4 if tau == 0.0 else True
        assert mass[0, k:].sum() < tau * total or k == 4
        if k > 0:
            assert mass[0, k - 1:].sum() >= tau * total


@pytest.mark.parametrize("packing", ["q8_0", "f16"])
def test_per_head_reads_equal_padded_batch(case, packing, monkeypatch):
    """Heads opening different amounts are read one by one; same numbers as the padded batch."""
    import longattn.sparse.layer as layer_mod

    qs, k, v, scale = case
    outs = {}
    for waste in (0.0, 1e9):  # always loop over KV heads / never
        monkeypatch.setattr(layer_mod, "PAD_WASTE", waste)
        layer = SCSALayer(small_cfg(packing=packing, cluster_size=24, tau_default=0.05), H, HKV, D)
        outs[waste] = torch.cat([layer.attend(q, k, v, scale) for q in qs])
        (acc,) = layer.debug_accounting()
        assert torch.equal(acc["coverage"], torch.ones_like(acc["coverage"]))
    assert torch.allclose(outs[0.0], outs[1e9], rtol=0, atol=1e-6)


def _leaves(tree, node):
    if bool(tree.is_leaf[node]):
        return [node]
    return [x for c in tree.children[node].tolist() if c >= 0 for x in _leaves(tree, c)]


def test_similarity_order_puts_each_group_of_leaves_in_one_subtree():
    """Four well-separated groups of 16 leaves, shuffled: each child of the root holds one group."""
    g = torch.Generator().manual_seed(0)
    M, Dl = 64, 8
    group = torch.randperm(M, generator=g) % 4
    cen = torch.zeros(1, M, Dl)
    cen[0, :, 0] = 10.0 * group
    cen = cen + 0.1 * torch.randn(1, M, Dl, generator=g)
    perm = similarity_order(cen, 4)
    assert sorted(perm.tolist()) == list(range(M))
    counts = torch.full((M,), 5, dtype=torch.int64)
    zeros = torch.zeros(1, M, Dl)
    for order, pure in (("similar", True), ("cache", False)):
        tree = build_tree(counts, cen.unsqueeze(2), zeros, zeros, zeros, torch.zeros(1, M), 4, order)
        kids = tree.children[tree.root].tolist()
        assert len(kids) == 4
        groups = [set(group[_leaves(tree, c)].tolist()) for c in kids]
        assert all(len(s) == 1 for s in groups) == pure
        assert sorted(x for c in kids for x in _leaves(tree, c)) == list(range(M))


@pytest.mark.parametrize("tree_order", ["similar", "cache"])
def test_tree_statistics_are_exact_aggregates_of_the_leaves(case, tree_order):
    """Whatever the leaf order, a node's count, centroid and value mean are those of its leaves."""
    qs, k, v, scale = case
    layer = SCSALayer(small_cfg(hierarchical=True, tree_order=tree_order), H, HKV, D)
    layer.attend(qs[0], k, v, scale)
    index, tree = layer.indexes[0], layer.indexes[0].tree
    M = tree.num_leaves
    assert torch.equal(tree.counts[:M], index.counts[:M])
    eps = torch.finfo(torch.float32).eps
    for node in range(M, tree.num_nodes):
        leaves = torch.tensor(_leaves(tree, node))
        m = index.counts[leaves].double()
        assert int(tree.counts[node]) == int(m.sum())
        for name, src in (("summ", index.summ[:, :, 0]), ("vmean", index.vmean)):
            want = (src[:, leaves].double() * m.view(1, -1, 1)).sum(1) / m.sum()  # [Hkv, D]
            got = (tree.summ[:, node, 0] if name == "summ" else tree.vmean[:, node]).double()
            # float64 aggregation rounded once to float32: half an ulp of the largest entry
            assert (got - want).abs().max() <= eps * src.abs().max().item(), name


def test_similar_tree_order_scores_fewer_nodes():
    """One KV head with pure leaves (cluster_size 16 ~ one run of a component): grouping similar
    leaves lets the walk leave whole off-topic subtrees as one tail each."""
    for topics in (1, 2):
        qs, k, v, scale = attn_case(4000, 3, 1, D, seed=9, queries=4, query_seed=1, topics=topics, centers=24)
        scored = {}
        for order in ("similar", "cache"):
            layer = SCSALayer(small_cfg(tau_default=0.02, tree_fanout=4, hierarchical=True, tree_order=order),
                              3, 1, D)
            for q in qs:
                layer.attend(q, k, v, scale)
                (acc,) = layer.debug_accounting()
                assert torch.equal(acc["coverage"], torch.ones_like(acc["coverage"]))
            scored[order] = layer.counters["clusters_scored"]
        assert scored["similar"] < scored["cache"], (topics, scored)
