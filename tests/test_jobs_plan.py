"""Partition planning: exact row ranges, bounded size, stable over reruns."""
from fusegen.jobs.plan import InputFile, Partition, plan_partitions


def test_small_row_groups_are_packed_and_big_ones_sliced():
    files = [InputFile("/a", (3, 3, 3, 10, 1, 1))]
    got = [(p.start, p.stop) for p in plan_partitions(files, 5)]
    assert got == [(0, 3), (3, 6), (6, 9), (9, 14), (14, 19), (19, 21)]


def test_partitions_cover_every_row_once_across_files():
    files = [InputFile("/a", (4, 4)), InputFile("/empty", (0,)), InputFile("/b", (7,)),
             InputFile("/c", ())]
    plan = plan_partitions(files, 3)
    assert plan[0] == Partition(0, "/a", 0, 3, 0)
    assert [p.index for p in plan] == list(range(len(plan)))
    rows = [(p.path, r) for p in plan for r in range(p.start, p.stop)]
    assert rows == [("/a", r) for r in range(8)] + [("/b", r) for r in range(7)]
    assert [p.first_row for p in plan if p.path == "/b"] == [8, 11, 14]
    assert all(1 <= p.num_rows <= 3 for p in plan)
    assert plan[-1].name == f"part-{len(plan) - 1:05d}.parquet"


def test_plan_is_deterministic():
    files = [InputFile("/a", (5, 100, 2)), InputFile("/b", (1000,))]
    assert plan_partitions(files, 64) == plan_partitions(list(files), 64)


def test_one_row_partitions():
    plan = plan_partitions([InputFile("/a", (2, 1))], 1)
    assert [(p.start, p.stop) for p in plan] == [(0, 1), (1, 2), (2, 3)]


def test_part_names_sort_in_input_order_past_99999_partitions():
    small = plan_partitions([InputFile("/a", (1,) * 100_000)], 1)
    assert (small[0].name, small[-1].name) == ("part-00000.parquet", "part-99999.parquet")
    big = plan_partitions([InputFile("/a", (1,) * 100_001)], 1)
    names = [p.name for p in big]
    assert (names[0], names[99_999], names[-1]) == (
        "part-000000.parquet", "part-099999.parquet", "part-100000.parquet")
    assert sorted(names) == names
