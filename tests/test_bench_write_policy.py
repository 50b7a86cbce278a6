import json

from bench.write_policy import run


def test_write_policies_trade_redis_bytes_for_cross_node_hits(tmp_path):
    result = run(quick=True, out_dir=tmp_path)
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == {"write_through", "write_back", "selective"}
    # Write-through shares everything at once; write-back shares only what placement demoted,
    # which never includes the hot system prompt, so node B cannot even start a prefix.
    assert rows["write_through"]["cross_node_hit_ratio"] == 1.0
    assert rows["write_back"]["cross_node_hit_ratio"] < 0.5
    assert rows["write_back"]["write_through_bytes"] == 0 and rows["write_back"]["demoted_bytes"] > 0
    assert rows["selective"]["write_through_bytes"] < rows["write_through"]["write_through_bytes"]
    assert json.loads((tmp_path / result["path"].split("/")[-1]).read_text())["rows"]
