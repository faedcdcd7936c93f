"""Property test (issue 14): random meshes, layouts and op chains, with and without backward, against plain
torch on one process. Cases are drawn here and run in batches on one pool per world size; the interpreter
is tests/property_chains.py. HP_PROPERTY_EXAMPLES raises the number of batches (scripts/property_long.sh)."""
import os

import pytest

from tests import property_chains as P

try:
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None

EXAMPLES = int(os.environ.get("HP_PROPERTY_EXAMPLES", "3"))
KEEP_GOING = bool(os.environ.get("HP_PROPERTY_KEEP_GOING"))   # the long run: count every batch, fail at the end
BATCH = int(os.environ.get("HP_PROPERTY_BATCH", "40"))
WORLD_MESHES = {2: ["2"], 4: ["4", "2x2"]}


if given is not None:
    def _case(world):
        return st.tuples(
            st.sampled_from(WORLD_MESHES[world]),
            st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 8]), min_size=1, max_size=3).map(tuple),
            st.integers(0, 1 << 14),                    # layout code
            st.integers(0, 5).map(lambda n: n == 0),   # a plain tensor input (1 in 6)
            st.lists(st.tuples(st.sampled_from(P.OPS + P.CASTS), st.integers(0, 255)), min_size=1, max_size=4),
            st.booleans(),                              # backward
            st.integers(0, 10_000),                     # seed
        )

    def _check(pool, cases, totals):
        try:
            per_rank = pool.run(P.run_cases, cases)
        except AssertionError as e:   # a rank died or the batch outlived the harness timeout: every case a hang
            if not KEEP_GOING:
                raise
            print(f"property chains: batch of {len(cases)} on {pool.world} ranks did not finish: {str(e)[:300]}")
            totals["hang"] = totals.get("hang", 0) + len(cases)
            return
        counts = P.verdicts(cases, per_rank)
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
        print(f"property chains: {len(cases)} cases on {pool.world} ranks: {counts}; so far {totals}", flush=True)
        failures = P.judge(cases, per_rank)
        if KEEP_GOING:
            for f in failures:
                print("FAILURE", f, flush=True)
            return
        assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures[:25])

    @pytest.mark.parametrize("world", [2, 4])
    def test_random_chains_match_plain_torch(world, dist2, dist4):
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("HP_PROPERTY_RANDOM"),
                  suppress_health_check=list(HealthCheck), database=None,
                  phases=[Phase.explicit, Phase.generate])  # no shrinking: a failure lists every failing case
        @given(st.lists(_case(world), min_size=BATCH, max_size=BATCH))
        def batches(cases):
            _check(dist2 if world == 2 else dist4, cases, totals)
        totals: dict = {}
        batches()
        print(f"property chains TOTAL on {world} ranks: {sum(totals.values())} cases: {totals}", flush=True)
        assert not totals.get("wrong") and not totals.get("hang"), totals


FEED_EXAMPLES = int(os.environ.get("HP_PROPERTY_FEED_EXAMPLES", "2"))

if given is not None:
    def _feed_case(world):
        return st.tuples(
            st.sampled_from(P.FEED_KINDS),
            st.sampled_from([1, 2, 4]),                               # rows
            st.sampled_from([4, 6, 8, 16]),                           # sequence length
            st.one_of(st.none(), st.sampled_from([0, 0, -2, 4])),     # attention_mask length - sequence length
            st.one_of(st.none(), st.sampled_from([0, -1, 2])),        # labels length - sequence length
            st.sampled_from(["none", "row", "batch", "wrong"]),       # position_ids
            st.sampled_from([-1, -1, -1, world - 1]),                 # a rank fed differently
            st.sampled_from(["rows", "seq", "labels"]),
        )

    @pytest.mark.parametrize("world", [2, 4])
    def test_random_entry_point_inputs_are_correct_or_loud(world, dist2, dist4):
        """Random inputs of context_parallel, expert_parallel and pipeline (mask / label / position shapes,
        batch sizes, one rank fed differently): the loss of one device on the global batch, or the same error on
        every rank; never a different loss, never a hang."""
        @settings(max_examples=FEED_EXAMPLES, deadline=None, derandomize=not os.environ.get("HP_PROPERTY_RANDOM"),
                  suppress_health_check=list(HealthCheck), database=None, phases=[Phase.explicit, Phase.generate])
        @given(st.lists(_feed_case(world), min_size=8, max_size=8))
        def batches(cases):
            pool = dist2 if world == 2 else dist4
            per_rank = pool.run(P.run_feed_cases, cases)
            print(f"entry-point inputs: {len(cases)} cases on {world} ranks: {P.verdicts(cases, per_rank)}", flush=True)
            failures = [f"{c}: {v}" for c, v in zip(cases, [[r[i] for r in per_rank] for i in range(len(cases))])
                        if P.classify(v) in ("wrong", "hang")]
            assert not failures, "\n".join(failures)
        batches()
