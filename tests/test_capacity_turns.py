"""The capacity benchmark's turns: a point measured several times gives the medians, a ratio the median of
the turns' own ratios (turn i against turn i), never a ratio of medians taken apart."""

from __future__ import annotations

from benchmarks.capacity import TURN_FIGURES, _latency_table, _ratio, _turn_order, combine_turns, turn_blocks


def _point(cpu: float, instructions: float | None = None, p99: int = 900) -> dict:
    point = dict.fromkeys(TURN_FIGURES, 1.0)
    point.update(redis_cpu_us_per_page=cpu, redis_cpu_less_idle_us_per_page=cpu - 4,
                 server_instructions_per_page=instructions, sync_p99_us=p99, bound="-", workers=4)
    return point


def test_one_turn_is_the_point_itself() -> None:
    point = _point(120.0, 450_000)
    assert combine_turns([point]) == point
    assert "turns" not in combine_turns([point])


def test_turns_give_medians_and_keep_the_first_turns_other_figures() -> None:
    combined = combine_turns([_point(130.0, 450_000, p99=800), _point(100.0, None, p99=2500),
                              _point(120.0, None, p99=3000)])
    assert combined["redis_cpu_us_per_page"] == 120.0
    assert combined["redis_cpu_less_idle_us_per_page"] == 116.0
    assert combined["server_instructions_per_page"] == 450_000  # the first turn's replay
    assert combined["sync_p99_us"] == 800
    assert [t["redis_cpu_us_per_page"] for t in combined["turns"]] == [130.0, 100.0, 120.0]


def test_a_ratio_pairs_the_turns() -> None:
    # turns' ratios 1.2, 1.3, 1.1: their median is 1.2; the medians taken apart (130 / 100) would say 1.3
    plain = combine_turns([_point(150.0, 450_000), _point(100.0), _point(90.0)])
    polite = combine_turns([_point(180.0, 540_000), _point(130.0), _point(99.0)])
    assert (polite["redis_cpu_us_per_page"], plain["redis_cpu_us_per_page"]) == (130.0, 100.0)
    assert _ratio(polite, plain, "redis_cpu_us_per_page") == 1.2
    assert _ratio(polite, plain, "server_instructions_per_page") == 1.2
    single = combine_turns([_point(100.0, 450_000)])
    assert _ratio(combine_turns([_point(125.0, 500_000)]), single, "redis_cpu_us_per_page") == 1.25


def test_every_other_turn_runs_the_modes_the_other_way_round() -> None:
    modes = ["plain", "polite"]
    assert [_turn_order(modes, turn) for turn in range(3)] == [modes, ["polite", "plain"], modes]
    assert modes == ["plain", "polite"]


def test_every_turn_measures_the_one_master_then_the_cluster_on_servers_of_its_own() -> None:
    blocks = turn_blocks(["plain", "polite", "sharded", "sharded-polite"], [1, 4, 16, 64], 2)
    assert [(turn, shards) for turn, shards, _ in blocks] == [(0, 1), (0, 3), (1, 1), (1, 3)]
    assert blocks[0][2][:2] == [(1, "plain"), (1, "polite")] and len(blocks[0][2]) == 8
    assert blocks[1][2] == [(4, "sharded"), (4, "sharded-polite"), (16, "sharded"), (16, "sharded-polite"),
                            (64, "sharded"), (64, "sharded-polite")]
    assert blocks[3][2][:2] == [(4, "sharded-polite"), (4, "sharded")]  # the other way round
    assert turn_blocks(["sharded"], [4], 3) == [(t, 3, [(4, "sharded")]) for t in range(3)]


def test_sync_p99_in_turns_is_their_median_each_turn_listed_with_its_bound() -> None:
    turns = [_point(100, p99=p99) | {"bound": bound, "sync_p50_us": 300} for p99, bound in
             ((2_148, "client"), (900, "-"), (1_100, "-"), (950, "-"), (2_400, "client"))]
    point = combine_turns(turns)
    [table] = _latency_table({"plain": [point]}, ["plain"])
    [row] = table["rows"]
    assert row[3] == 1_100 and row[4] == "2,148 / 900 / 1,100 / 950 / 2,400"
    assert row[-2:] == ["yes", "client / - / - / - / client"]
    [alone] = _latency_table({"plain": [turns[0]]}, ["plain"])  # one turn: the point's own figure
    assert alone["rows"][0][3:] == [2_148, "≤ 2,000", "no", "client"]
