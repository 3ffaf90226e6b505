"""The routing policy (deployments/routing/policy.py), a replica's view of its peers, and the prefix digests the engine
reports against the ones a router computes for a prompt."""

from __future__ import annotations

import dataclasses

import pytest

from deployments.routing.peer_view import PeerView
from deployments.routing.policy import RouteRequest, RoutingPolicy, rank
from engine import LLM, SamplingParams
from engine.block_manager import prompt_digests
from lora_cache.replica_report import AdapterTier, AdapterVersion, ClusterView, ReplicaReport

POLICY = RoutingPolicy(imbalance=8, hot_adapter_requests=4)


def _held(*names: str) -> tuple[AdapterVersion, ...]:
    return tuple(AdapterVersion(name, f"content-of-{name}") for name in names)


def _names(ranks: list[list[ReplicaReport]]) -> list[set[str]]:
    return [{r.replica for r in group} for group in ranks]


def test_adapter_tier_orders_slot_then_cpu_then_node_store_then_cold():
    reports = [ReplicaReport("cold"), ReplicaReport("cpu", cpu=_held("a")), ReplicaReport("slot", device=_held("a")),
               ReplicaReport("store", node_store=frozenset(_held("a")))]
    assert _names(rank(RouteRequest("a"), reports, POLICY)) == [{"slot"}, {"cpu"}, {"store"}, {"cold"}]
    assert reports[1].tier("a") is AdapterTier.CPU and reports[0].tier(None) is AdapterTier.SLOT
    view = ClusterView([], frozenset(_held("a")), "node-1")
    assert view.node_store("node-1") == set(_held("a")) and view.node_store("node-2") == frozenset()


def test_residence_is_one_identity_a_name_and_its_content_id():
    """Reports name adapters as clients do, whatever key a replica's engine runs them under; a request that knows the
    version it wants ranks the replica holding that version first."""
    reports = [ReplicaReport("old", device=(AdapterVersion("a", "v1"),)),
               ReplicaReport("new", cpu=(AdapterVersion("a", "v2"),)), ReplicaReport("none")]
    assert _names(rank(RouteRequest("a"), reports, POLICY)) == [{"old"}, {"new"}, {"none"}]
    assert _names(rank(RouteRequest("a", "v2"), reports, POLICY)) == [{"new"}, {"old", "none"}]
    assert reports[0].held() == ["a"] and reports[2].tier("a#1") is AdapterTier.COLD


def test_longest_cached_prefix_ranks_first_after_residence():
    digests = (11, 12, 13)
    reports = [ReplicaReport("one", prefix_digests=frozenset({11})),
               ReplicaReport("two", prefix_digests=frozenset({11, 12, 99})),
               ReplicaReport("gap", prefix_digests=frozenset({12, 13})),  # no first block: nothing usable
               ReplicaReport("slot", device=_held("a"))]
    assert _names(rank(RouteRequest(None, prompt_digests=digests), reports, POLICY)) == [{"two"}, {"one"}, {"gap", "slot"}]
    assert _names(rank(RouteRequest("a", prompt_digests=digests), reports, POLICY))[0] == {"slot"}  # residence before prefix


def test_load_band_puts_overloaded_replicas_last_least_loaded_first():
    reports = [ReplicaReport("holder", device=_held("a"), running=20), ReplicaReport("idle"),
               ReplicaReport("busy", running=30), ReplicaReport("near", running=8)]
    assert _names(rank(RouteRequest("a"), reports, POLICY)) == [{"idle", "near"}, {"holder"}, {"busy"}]


def test_a_replica_with_a_full_kv_cache_ranks_last():
    reports = [ReplicaReport("holder", device=_held("a"), kv_utilisation=0.95), ReplicaReport("other", running=3)]
    assert _names(rank(RouteRequest("a"), reports, POLICY)) == [{"other"}, {"holder"}]
    full = [ReplicaReport("a", running=2, kv_utilisation=0.97), ReplicaReport("b", running=1, kv_utilisation=0.99)]
    assert _names(rank(RouteRequest(), full, POLICY)) == [{"b"}, {"a"}]  # all full: least loaded first


def test_hot_adapter_loses_its_residence_preference():
    cool = [ReplicaReport("holder", device=_held("a"), running=3, adapter_requests={"a": 3}), ReplicaReport("other")]
    assert _names(rank(RouteRequest("a"), cool, POLICY))[0] == {"holder"}
    hot = [ReplicaReport("holder", device=_held("a"), running=4, adapter_requests={"a": 4}), ReplicaReport("other")]
    assert _names(rank(RouteRequest("a"), hot, POLICY)) == [{"holder", "other"}]
    two_holders = hot + [ReplicaReport("second", cpu=_held("a"), running=1, adapter_requests={"a": 1})]
    # one holder is not busy: the adapter stays with its holders, which rank alike (a slot and a CPU copy, a cached
    # prefix or none), so load spreads it over them
    digests = (11, 12)
    two_holders[0] = dataclasses.replace(two_holders[0], prefix_digests=frozenset(digests))
    assert _names(rank(RouteRequest("a", prompt_digests=digests), two_holders, POLICY)) == [{"holder", "second"},
                                                                                             {"other"}]


def test_a_rank_of_equals_is_cut_to_two_at_random():
    reports = [ReplicaReport(f"r{i}") for i in range(6)]
    seen = set()
    for _ in range(50):
        [group] = rank(RouteRequest(), reports, POLICY)
        assert len(group) == 2
        seen |= {r.replica for r in group}
    assert seen == {r.replica for r in reports}


def test_target_goes_first_unless_outside_the_band():
    reports = [ReplicaReport("slot", device=_held("a")), ReplicaReport("chosen", running=2)]
    assert _names(rank(RouteRequest("a", target="chosen"), reports, POLICY))[0] == {"chosen"}
    reports[1] = ReplicaReport("chosen", running=40)
    assert _names(rank(RouteRequest("a", target="chosen"), reports, POLICY)) == [{"slot"}, {"chosen"}]


def test_serve_probes_a_target_several_times_before_the_other_ranks():
    from deployments.routing.request_router import TARGET_PROBES, probe_order

    reports = [ReplicaReport("sender"), ReplicaReport("holder", cpu=_held("a"))]
    ranks = rank(RouteRequest("a", target="holder"), reports, POLICY)
    assert _names(probe_order(RouteRequest("a", target="holder"), ranks)) == [{"holder"}] * TARGET_PROBES + [{"sender"}]
    untargeted = rank(RouteRequest("a"), reports, POLICY)
    assert probe_order(RouteRequest("a"), untargeted) == untargeted
    reports[1] = ReplicaReport("holder", cpu=_held("a"), running=40)  # outside the band: not first, not repeated
    ranks = rank(RouteRequest("a", target="holder"), reports, POLICY)
    assert _names(probe_order(RouteRequest("a", target="holder"), ranks)) == [{"sender"}, {"holder"}]


def test_no_hot_level_leaves_an_adapter_with_its_holders():
    """hot_adapter_requests None: residence alone ranks, however many of the adapter's requests its holder runs."""
    policy = RoutingPolicy(imbalance=100, hot_adapter_requests=None)
    reports = [ReplicaReport("holder", device=_held("a"), running=90, adapter_requests={"a": 90}),
               ReplicaReport("other")]
    assert _names(rank(RouteRequest("a"), reports, policy)) == [{"holder"}, {"other"}]
    hot_at_4 = RoutingPolicy(imbalance=100, hot_adapter_requests=4)
    assert _names(rank(RouteRequest("a"), reports, hot_at_4)) == [{"holder", "other"}]  # load decides


def test_a_choice_without_a_reservation_takes_each_rank_one_replica_at_a_time_at_random():
    """HAProxy's ingress router: Serve's queue-length cache goes stale, so each rank's replicas come one by one."""
    from deployments.routing.request_router import probe_order

    reports = [ReplicaReport("a", device=_held("x")), ReplicaReport("b", device=_held("x")), ReplicaReport("c")]
    request = RouteRequest("x", unreserved=True)
    firsts = set()
    for _ in range(40):
        order = probe_order(request, rank(request, reports, POLICY))
        assert [len(group) for group in order] == [1, 1, 1] and order[2][0].replica == "c"
        firsts.add(order[0][0].replica)
    assert firsts == {"a", "b"}


def test_policy_refuses_bad_values():
    with pytest.raises(ValueError, match="hot_adapter_requests"):
        RoutingPolicy(imbalance=-1)
    with pytest.raises(ValueError, match="kv_high"):
        RoutingPolicy(kv_high=1.5)


def test_peer_view_serves_here_when_among_the_best_and_spreads_a_burst():
    view = PeerView(POLICY)
    own = ReplicaReport("me")
    assert view.choose(RouteRequest("a"), own) is None  # no peers yet
    view.update([ReplicaReport("peer", cpu=_held("a"), node_store=frozenset(_held("a", "b")))])
    assert view.choose(RouteRequest("c"), own) is None  # nobody holds c: equal, served here
    targets = [view.choose(RouteRequest("a"), own) for _ in range(12)]
    forwarded = [t for t in targets if t is not None]
    assert forwarded and all(t.target == "peer" and t.adapter == "a" for t in forwarded)
    assert len(forwarded) == POLICY.imbalance + 1  # then the peer's counted load leaves the band
    view.update(None)  # the cache actor restarts
    assert view.choose(RouteRequest("a"), own) is None


def test_peer_view_forwards_only_to_peers_serve_routes_to():
    """A peer Serve stopped (a scale-down, a rolling update) still has a fresh report while it drains: a request
    forwarded to it would come back here through Ray, so it is served here or by a live peer."""
    live = {"ids": None}
    view = PeerView(POLICY, lambda: live["ids"])
    own = ReplicaReport("me@node-1")
    view.update([ReplicaReport("stopping@node-1", device=_held("a")), ReplicaReport("kept@node-2", cpu=_held("a"))])
    assert view.choose(RouteRequest("a"), own).target == "stopping@node-1"  # Serve's set not known yet: all count
    live["ids"] = frozenset({"me", "kept"})
    assert view.choose(RouteRequest("a"), own).target == "kept@node-2"
    live["ids"] = frozenset({"me"})
    assert view.choose(RouteRequest("a"), own) is None


def test_peer_view_counts_only_the_forwards_still_in_flight():
    """Requests forwarded one after another, each ended before the next, keep going to the holder: only a burst in
    flight pushes it out of the load band."""
    view = PeerView(POLICY)
    own = ReplicaReport("me")
    view.update([ReplicaReport("holder", device=_held("a"), running=4)])
    for _ in range(3 * POLICY.imbalance):
        route = view.choose(RouteRequest("a"), own)
        assert route is not None and route.target == "holder"
        view.finished(route)
    burst = [view.choose(RouteRequest("a"), own) for _ in range(POLICY.imbalance)]
    assert burst.count(None) == 3  # 4 running there and 5 more in flight fill the band (the floor 0 plus 8)
    view.update([ReplicaReport("holder", device=_held("a"), running=8)])
    for route in burst:  # ended after a report that counted them: not taken off twice
        if route is not None:
            view.finished(route)
    assert view.choose(RouteRequest("a"), own) is not None


def test_engine_reports_the_digests_a_router_computes_for_its_prompt(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), block_size=4, log_stats=False)
    prompt = list(range(5, 31))  # 26 tokens: 6 full blocks that a later prompt can take
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    cached = llm.engine.cached_prefix_digests()
    digests = prompt_digests(prompt, None, 4)
    assert len(digests) == 6 and set(digests) <= cached
    report = ReplicaReport("r", prefix_digests=cached)
    assert report.cached_blocks(prompt_digests(prompt[:13] + [1, 2, 3, 4], None, 4)) == 3
    assert report.cached_blocks(prompt_digests(prompt, "an-adapter", 4)) == 0  # another adapter's K/V differ
    # a truncated prompt is cached as cut, and a router digests it as cut (SamplingParams.kept_prompt)
    cut, long = SamplingParams(max_tokens=1, truncate_prompt_tokens=12), list(range(100, 140))
    llm.generate([long], cut, use_tqdm=False)
    kept = prompt_digests(cut.kept_prompt(long), None, 4)
    assert kept and set(kept) <= llm.engine.cached_prefix_digests()
    assert not set(prompt_digests(long, None, 4)) & llm.engine.cached_prefix_digests()


def test_the_residence_published_is_of_current_versions_only():
    """/v1/models' residence: a replica's report that still names an adapter unloaded since does not list it again;
    one that names an adapter of the source the cache actor no longer holds (a restarted actor) still lists it."""
    from lora_cache.cache_stats import CachedAdapter, CacheStats, ReplicaHolding

    stats = CacheStats(adapters={"late#2": CachedAdapter(10, "v2")}, registered={"late": "/adapters/late"},
                       generations={"late": 2, "gone": 3},
                       replicas={"r1": ReplicaHolding(("late", "gone"), ("root",))}, nbytes=10, capacity_bytes=None,
                       hits=0, misses=0, load_counts={}, load_seconds={})
    residence = stats.residence()
    assert sorted(residence) == ["late", "root"]
    assert residence["late"].content_id == "v2" and residence["late"].device_replicas == ("r1",)
    assert residence["root"].cpu_replicas == ("r1",) and residence["root"].content_id is None
