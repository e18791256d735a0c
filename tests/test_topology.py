from ddp_lab.lessons import topology


def test_ranks_are_numbered_node_by_node():
    table = topology.rank_table(nnodes=3, nproc_per_node=2)
    assert [r["rank"] for r in table] == list(range(6))
    assert all(r["rank"] == r["node"] * 2 + r["local_rank"] for r in table)
    assert {r["world_size"] for r in table} == {6}
