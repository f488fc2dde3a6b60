"""An ONNX export's graph decides its answers as much as its weights do (docs/reliability.md, "Hostile
input"): ``model_sha256`` covers the whole model, so one flipped attribute bit or two swapped input
names are refused with exit 5; only the operators drl's exporters write load (a Loop with a huge trip
count would hang ``predict``); the exported bytes carry no path of the exporting machine; and
onnxruntime's own log lines, which quote the file's names raw, never reach the terminal."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import drlcli
from drlcli.cli import app
from drlcli.commands.export import export_run
from drlcli.errors import IntegrityError
from drlcli.serving.formats import load_model
from drlcli.serving.graph import JSON_KEYS, MODEL_SHA256
from drlcli.serving.modelfile import with_checksum
from drlcli.serving.onnx import _onnx_payload_sha256, seal_onnx

HAS_ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))
pytestmark = pytest.mark.skipif(not HAS_ONNX, reason="the export extra (onnx, onnxruntime) is missing")
runner = CliRunner()
HOSTILE = "EVIL\x1b[31m"  # an escape sequence in a name taken from the file


@pytest.fixture(scope="module")
def exported(learned_run, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("onnx-integrity") / "m.onnx"
    export_run(learned_run, path)
    return path


@pytest.fixture(scope="module")
def images(stage_folders) -> list[Path]:
    return sorted(stage_folders[1][1].rglob("*.png"))[::4]  # 3 images of the second stage's classes


def _proto(path: Path) -> Any:
    import onnx

    return onnx.load(str(path))


def _write(proto: Any, out: Path, *, seal: bool = False) -> Path:
    """``proto`` as a file; ``seal``: with every checksum recomputed (weights, spec, model), as a crafter would."""
    if seal:
        spec = _spec(proto)
        _set_spec(proto, with_checksum({**spec, "payload_sha256": _onnx_payload_sha256(proto)}))
    out.write_bytes(seal_onnx(proto) if seal else proto.SerializeToString())
    return out


def _spec(proto: Any) -> dict[str, Any]:
    props = [e for e in proto.metadata_props if e.key != MODEL_SHA256]
    return {e.key: json.loads(e.value) if e.key in JSON_KEYS else e.value for e in props}


def _set_spec(proto: Any, spec: dict[str, Any]) -> None:
    """The model's metadata: ``spec`` alone (no model checksum)."""
    del proto.metadata_props[:]
    for key, value in spec.items():
        proto.metadata_props.add(key=key, value=value if isinstance(value, str) else json.dumps(value))


def _predict(path: Path, images: list[Path]):
    return runner.invoke(app, ["predict", *map(str, images), "--model", str(path), "--json", "-q"])


def _refused(result) -> str:
    """The one error line of a refused file (exit 5), as the JSON error says it."""
    assert result.exit_code == 5, (result.exit_code, result.stdout, result.stderr)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    return json.loads(result.stdout)["error"]["message"]


# ----------------------------------------------------------------------- the whole model is sealed


def _first(proto: Any, op_type: str) -> Any:
    return next(node for node in proto.graph.node if node.op_type == op_type)


def test_a_flipped_layernorm_epsilon_bit_is_refused(exported, images, tmp_path):
    """One bit of one attribute turned known images into "unknown" with exit 0 before graphs were sealed."""
    proto = _proto(exported)
    epsilon = next(a for a in _first(proto, "LayerNormalization").attribute if a.name == "epsilon")
    (bits,) = struct.unpack("<I", struct.pack("<f", epsilon.f))
    (epsilon.f,) = struct.unpack("<f", struct.pack("<I", bits ^ (1 << 30)))
    message = _refused(_predict(_write(proto, tmp_path / "eps.onnx"), images))
    assert message == f"{tmp_path / 'eps.onnx'} is damaged (graph checksum mismatch); export it again"


def test_swapped_input_names_are_refused(exported, images, tmp_path):
    """Two input names of one node swapped relabelled every image before."""
    proto = _proto(exported)
    node = [n for n in proto.graph.node if n.op_type == "Sub"][-1]  # the scores' last step
    node.input[0], node.input[1] = node.input[1], node.input[0]
    assert "graph checksum mismatch" in _refused(_predict(_write(proto, tmp_path / "swap.onnx"), images))


def _edited(attr: Any) -> bool:
    """Flip one bit of ``attr``'s value (a FLOATS list: double its first); False for a kind not edited."""
    from onnx import AttributeProto as A

    if attr.type == A.FLOAT:
        (bits,) = struct.unpack("<I", struct.pack("<f", attr.f))
        (attr.f,) = struct.unpack("<f", struct.pack("<I", bits ^ 1))
    elif attr.type == A.INT:
        attr.i ^= 1
    elif attr.type == A.STRING:
        attr.s = attr.s[:-1] + bytes([attr.s[-1] ^ 1]) if attr.s else b"x"
    elif attr.type == A.INTS and attr.ints:
        attr.ints[0] ^= 1
    elif attr.type == A.FLOATS and attr.floats:
        attr.floats[0] *= 2
    elif attr.type == A.TENSOR and attr.t.raw_data:
        attr.t.raw_data = bytes([attr.t.raw_data[0] ^ 1]) + attr.t.raw_data[1:]
    else:
        return False
    return True


def test_every_single_attribute_edit_is_refused(exported, tmp_path):
    """Each one-bit edit of each node attribute (about 170; 32 of them changed answers silently before)."""
    proto, out, edits = _proto(exported), tmp_path / "edit.onnx", 0
    for n, node in enumerate(proto.graph.node):
        for a in range(len(node.attribute)):
            edited = _proto(exported)
            if not _edited(edited.graph.node[n].attribute[a]):
                continue
            _write(edited, out)
            with pytest.raises(IntegrityError, match=r"damaged \(graph checksum mismatch\)") as info:
                load_model(out)
            assert info.value.exit_code == 5
            edits += 1
    assert edits >= 100


def test_an_unsealed_or_unstamped_export_is_refused(exported, images, tmp_path):
    """No model_sha256, two of them, or a format-3 file (before graphs were sealed): exit 5, export again."""
    proto = _proto(exported)
    props = proto.metadata_props
    (index,) = [i for i, e in enumerate(props) if e.key == MODEL_SHA256]
    twice = props.add()
    twice.key, twice.value = MODEL_SHA256, props[index].value
    assert "graph checksum mismatch" in _refused(_predict(_write(proto, tmp_path / "twice.onnx"), images))
    del props[len(props) - 1]
    del props[index]
    assert "graph checksum mismatch" in _refused(_predict(_write(proto, tmp_path / "none.onnx"), images))
    _set_spec(proto, with_checksum({**_spec(proto), "format_version": "3"}))  # the previous release's: unsealed
    message = _refused(_predict(_write(proto, tmp_path / "old.onnx"), images))
    assert message == (
        f"{tmp_path / 'old.onnx'} is a drl ONNX export of format 3, from an older drl whose checksums leave its "
        "graph out; export it again from its run with this drl"
    )


# ------------------------------------------------------------------- only the exporters' operators


def _loop(output: str, source: str) -> Any:
    """A Loop node running 2^62 times (``source`` carried through): it would hang predict."""
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [helper.make_node("Identity", ["keep_in"], ["keep_out"]), helper.make_node("Identity", ["v_in"], ["v_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("keep_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("keep_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", TensorProto.FLOAT, None),
        ],
    )
    return helper.make_node("Loop", ["trips", "keep", source], [output], body=body)


def _true() -> Any:
    from onnx import TensorProto, helper

    return helper.make_tensor("", TensorProto.BOOL, [], [1])


def _with_loop(proto: Any, *, in_branch: bool) -> Any:
    """``scores`` through a Loop (``in_branch``: inside an If's then-branch, where only a walk of subgraphs finds it)."""
    from onnx import TensorProto, helper

    producer = next(n for n in proto.graph.node if "scores" in n.output)
    producer.output[list(producer.output).index("scores")] = "scores_raw"
    for name, value in (("trips", helper.make_tensor("", TensorProto.INT64, [], [2**62])), ("keep", _true())):
        proto.graph.node.append(helper.make_node("Constant", [], [name], value=value))  # weights unchanged
    if not in_branch:
        proto.graph.node.append(_loop("scores", "scores_raw"))
        return proto
    out = helper.make_tensor_value_info("branch_out", TensorProto.FLOAT, None)
    then = helper.make_graph([_loop("branch_out", "scores_raw")], "then", [], [out])
    other = helper.make_graph([helper.make_node("Identity", ["scores_raw"], ["branch_out"])], "else", [], [out])
    proto.graph.node.append(helper.make_node("If", ["keep"], ["scores"], then_branch=then, else_branch=other))
    return proto


def _renamed_op(op_type: str) -> Callable[[Any], Any]:
    def rename(proto: Any) -> Any:
        _first(proto, "Softmax").op_type = op_type
        return proto

    return rename


def _with_function(proto: Any) -> Any:
    proto.functions.add(name="helper", domain="")
    return proto


CRAFTED_GRAPHS = {
    "Loop, trip count 2^62": (lambda p: _with_loop(p, in_branch=False), "uses operators ['Loop']"),
    "Loop inside an If branch": (lambda p: _with_loop(p, in_branch=True), "uses operators ['Loop']"),
    "Scan": (_renamed_op("Scan"), "uses operators ['Scan']"),
    "a standard op drl never writes": (_renamed_op("Hardmax"), "uses operators ['Hardmax']"),
    "a model-local function": (_with_function, "defines ONNX functions"),
}


@pytest.mark.parametrize("case", list(CRAFTED_GRAPHS))
def test_operators_the_exporter_never_writes_are_refused(exported, images, tmp_path, case):
    """Refused before onnxruntime sees the file: with the stale checksum (any edit), and resealed by a
    crafter (the operator allowlist), each with one error line naming the operator and exit 5."""
    craft, message = CRAFTED_GRAPHS[case]
    stale = _write(craft(_proto(exported)), tmp_path / "stale.onnx")
    with pytest.raises(IntegrityError):  # load only: before this fix, predict on it hung
        load_model(stale)
    resealed = _write(craft(_proto(exported)), tmp_path / "crafted.onnx", seal=True)
    with pytest.raises(IntegrityError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_model(resealed)
    text = _refused(_predict(resealed, images))
    assert message in text and "export" in text and "again" in text


def test_what_the_exporters_write_is_allowed_and_sealed(exported):
    """Every op of a fresh export is allowlisted; the file's checksum covers it as written."""
    from drlcli.serving.onnx import ONNX_OPS, _graph_ops, onnx_model_sha256

    proto = _proto(exported)
    assert {op for _, op in _graph_ops(proto.graph)} <= ONNX_OPS
    (sealed,) = [e.value for e in proto.metadata_props if e.key == MODEL_SHA256]
    kept = [(e.key, e.value) for e in proto.metadata_props if e.key != MODEL_SHA256]
    del proto.metadata_props[:]
    for key, value in kept:
        proto.metadata_props.add(key=key, value=value)
    assert onnx_model_sha256(proto) == sealed


# ------------------------------------------------------------------------- no paths of the machine


def test_the_export_carries_no_path_of_the_exporting_machine(exported):
    """torch's exporter notes each node's stack trace (absolute source paths) in node metadata: stripped."""
    data = exported.read_bytes()
    places = {
        Path(drlcli.__file__).resolve().parents[1],  # the repository (or site-packages for an install)
        Path(torch.__file__).resolve().parents[1],  # site-packages
        Path(sys.prefix).resolve(),
    }
    for place in places:
        assert str(place).encode() not in data, place
    assert b"stack_trace" not in data and b'File "' not in data
    proto = _proto(exported)
    nodes = list(proto.graph.node)
    assert not any(n.doc_string or len(n.metadata_props) for n in nodes)
    assert not proto.graph.doc_string and not len(proto.graph.metadata_props)


# ------------------------------------------------------------------ onnxruntime stays off stderr


def _answers(result) -> list[dict[str, Any]]:
    assert result.exit_code == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_onnxruntime_log_lines_never_reach_the_terminal(exported, images, tmp_path, capfd):
    """onnxruntime writes its warnings and errors to file descriptor 2 itself, quoting node names from
    the file raw: a crafted, resealed file (hostile names, an unused initializer it warns about, then
    a graph that fails at run time) gives drl's own lines only, and the answers are the original's."""
    from onnx import TensorProto, helper

    proto = _proto(exported)
    for node in proto.graph.node:
        node.name = HOSTILE + node.name
    proto.graph.initializer.append(helper.make_tensor(HOSTILE + "unused", TensorProto.FLOAT, [1], [0.0]))
    noisy = _write(proto, tmp_path / "noisy.onnx", seal=True)
    capfd.readouterr()
    assert _answers(_predict(noisy, images)) == _answers(_predict(exported, images))
    proto.graph.initializer.append(helper.make_tensor("far", TensorProto.INT64, [], [1000]))
    _first(proto, "Gather").input[1] = "far"  # an index out of range: fails inside onnxruntime, at run time
    failing = _write(proto, tmp_path / "failing.onnx", seal=True)
    message = _refused(_predict(failing, images))
    assert message.startswith("the onnx graph cannot score") and "export it again" in message
    captured = capfd.readouterr()
    assert HOSTILE not in captured.err and "onnxruntime" not in captured.err, captured.err


def test_a_copied_export_loads_and_scores_as_written(exported, images, tmp_path):
    """Sealing survives a copy: the checksum is over the model, not the file's name or place."""
    copy = Path(shutil.copy(exported, tmp_path / "copy.onnx"))
    assert _answers(_predict(copy, images)) == _answers(_predict(exported, images))
