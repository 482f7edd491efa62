"""What FastDeploy reads, kvtd reads. FastDeploy's own reader of
<model_path>/version.yaml (fastdeploy/cache_manager/cache_transfer_manager.py,
get_key_prefix_from_version: yaml.safe_load(f)["version"], then the first two '-' parts), taken
from the reference source by its syntax tree (the module itself needs paddle), run on every case of
tests/data/version_yaml_cases.json: its answer must be the case's. config_test's
VersionYaml.EveryCaseReadsAsFastDeploysReaderReadsIt checks kvtd's reader against the same cases,
so the two readers agree. Before, a trailing comment, a BOM, a quoted key, a flow mapping and
duplicate keys made kvtd exit 2 on files FastDeploy accepts."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from fastdeploy_harness import fastdeploy_source, skip_reason  # noqa: E402

CASES = Path(__file__).resolve().parents[2] / "data" / "version_yaml_cases.json"


def fastdeploys_reader():
    src = fastdeploy_source()
    if src is None:
        pytest.skip(skip_reason())
    path = src / "fastdeploy" / "cache_manager" / "cache_transfer_manager.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_key_prefix_from_version")
    scope = {"yaml": yaml}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), scope)  # noqa: S102 - FastDeploy's code
    return scope["get_key_prefix_from_version"]


@pytest.mark.parametrize("case", json.loads(CASES.read_text())["cases"], ids=lambda c: c["name"])
def test_fastdeploys_reader_gives_each_cases_answer(case, tmp_path):
    read = fastdeploys_reader()
    f = tmp_path / "version.yaml"
    f.write_bytes(case["text"].encode("utf-8"))
    if case["prefix"] is None:
        with pytest.raises(Exception):
            read(str(f))
    else:
        assert read(str(f)) == case["prefix"]
