"""AgentRun validation: every bad file is refused before anything runs, with a message naming the field.

The corpus lives in ``manifests/examples/bad/`` (one mistake per file, said in its first line).
``BAD`` below is the table: file -> the field paths (and key words) its error must name. A file in
the folder without a row in the table fails the suite, so the corpus and the table stay in step.
The CLI half runs ``agentfast run FILE`` as a real process against a real Postgres and checks it
exits 2, names the field, and registers no run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agentfast.runner.spec import SpecError, load_agentrun, parse_agentrun

from .helpers import EXAMPLES, spawn_cli

BAD_DIR = EXAMPLES / "bad"

# file -> substrings the error must contain; the first is always the field path.
BAD: dict[str, list[str]] = {
    "unknown-tool-ref.yaml": ["spec.tools[0].ref", "unknown tool 'lookup_order'", "refnud"],
    "tool-ref-not-a-tool.yaml": ["spec.tools[0].ref", "os:getcwd", "not decorated"],
    "no-model.yaml": ["spec.model", "Field required"],
    "model-baseurl-and-script.yaml": ["spec.model.baseURL", "not a field of an AgentRun", "ModelConfig", "spec.model.config"],
    "model-inline-api-key.yaml": ["spec.model.apiKeySecretRef", "not a field of an AgentRun", "ModelConfig"],
    "model-config-and-script.yaml": ["spec.model", "exactly one of config", "script"],
    "model-config-missing.yaml": ["spec.model.config", "'no-such-config'", "holds no ModelConfig"],
    "model-not-allowed.yaml": ["spec.model.name", "'gpt-4o'", "ModelConfig 'openai'", "gpt-4o-mini"],
    "modelconfig-bad-url.yaml": ["ModelConfig 'openai': spec.baseURL", "http or https URL"],
    "modelconfig-beside-a-secret.yaml": ["modelconfig-beside-a-secret.yaml", "kind 'Secret'", "AGENTFAST_MODEL_API_KEY"],
    "unknown-script.yaml": ["spec.model.script", "no-such-script"],
    "negative-budget.yaml": ["spec.budget.max_tokens", "greater than 0"],
    "zero-max-iterations.yaml": ["spec.budget.max_iterations", "greater than 0"],
    "wrong-types.yaml": ["spec.tools", "valid list", "spec.budget.max_iterations", "valid integer"],
    "unknown-classifier.yaml": ["spec.budget.classifier", "agentfast.runner.nosuch"],
    "unknown-spec-field.yaml": ["spec.maxIterations", "Extra inputs are not permitted"],
    "bad-metadata-name.yaml": ["metadata.name", "pattern"],
    "two-documents.yaml": ["two-documents.yaml", "exactly one AgentRun document, found 2"],
    "not-yaml.yaml": ["not-yaml.yaml", "not valid YAML", "line 4"],
    "not-a-mapping.yaml": ["(document)", "expected a mapping", "got list"],
    "wrong-api-version.yaml": ["apiVersion", "agentfast.dev/v1alpha1"],
    "duplicate-tool-names.yaml": ["spec.tools", "tool names must be unique", "lookup_order"],
    "bad-tool-name.yaml": ["spec.tools[0].name", "pattern"],
    "langgraph-without-graph.yaml": ["spec.graph.ref", "langgraph"],
    "bad-approval-decision.yaml": ["spec.approvals.call-2-0.decision", "'approve', 'deny' or 'complete'"],
    "deny-without-reason.yaml": ["spec.approvals.call-2-0", "a denial needs a reason"],
    "empty-input.yaml": ["spec.input", "at least 1 character"],
}

# Checked before a run starts (spec.preflight, used by the CLI): load_agentrun imports refs but does not
# check what they are, nor load model scripts.
PREFLIGHT_ONLY = {"tool-ref-not-a-tool.yaml", "unknown-classifier.yaml", "unknown-script.yaml"}


def _good_doc() -> dict:
    return yaml.safe_load((EXAMPLES / "refund.yaml").read_text())


def _preflight_error(path: Path) -> str:
    """The error of the checks made before a run starts: ``resolve`` (classifier, script) and the
    tool registry the tool host builds (runner/toolhost.py: the tools are imported there)."""
    from agentfast.runner.spec import resolve
    from agentfast.runner.tools import ToolRegistry

    with pytest.raises(SpecError) as err:
        run = load_agentrun(path)
        resolve(run)
        ToolRegistry.from_agentrun(run)
    return str(err.value)


def test_corpus_and_table_are_in_step() -> None:
    on_disk = sorted(p.name for p in BAD_DIR.glob("*.yaml"))
    assert on_disk == sorted(BAD), "every file in manifests/examples/bad needs a row in BAD (and vice versa)"
    for name in on_disk:
        first = (BAD_DIR / name).read_text().splitlines()[0]
        assert first.startswith("# Bad:"), f"{name}: first line should say what is wrong"


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_file_is_refused_naming_the_field(name: str) -> None:
    path = BAD_DIR / name
    if name in PREFLIGHT_ONLY:
        message = _preflight_error(path)
    else:
        with pytest.raises(SpecError) as err:
            load_agentrun(path)
        message = str(err.value)
    for needle in BAD[name]:
        assert needle in message, f"{name}: {needle!r} not in error:\n{message}"
    # One line per problem, each starting with where it is (a field path, or the file/document).
    for line in message.splitlines():
        if line.startswith((" ", "\t")) or name == "not-yaml.yaml":
            continue  # YAML parser detail lines
        assert ":" in line and not line.startswith(":"), f"{name}: line without a location: {line!r}"


def test_the_shipped_example_is_valid() -> None:
    run = load_agentrun(EXAMPLES / "refund.yaml")
    assert run.metadata.name == "refund-demo"
    assert [t.name for t in run.spec.tools] == ["lookup_order", "issue_refund", "add_case_note"]
    from agentfast.runner.spec import resolve

    assert resolve(run).script is not None  # does not raise; the scripted model's script is loaded


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d["spec"].pop("input"), "spec.input"),
        (lambda d: d["spec"]["budget"].update(max_duration_ms=-5), "spec.budget.max_duration_ms"),
        (lambda d: d["spec"]["budget"].update(max_tokens="many"), "spec.budget.max_tokens"),
        (lambda d: d["spec"]["budget"].update(maxTokens=5), "spec.budget.maxTokens"),
        (lambda d: d["spec"]["model"].update(timeoutSeconds=0), "spec.model.timeoutSeconds"),
        (lambda d: d["spec"]["model"].update(config="Bad_Name", script=None), "spec.model.config"),
        (lambda d: d["spec"]["model"].update(name=""), "spec.model.name"),
        (lambda d: d["spec"]["tools"][1].update(ref="no_colon_here"), "spec.tools[1].ref"),
        (lambda d: d["spec"]["tools"][2].update(requiresApproval="sometimes"), "spec.tools[2].requiresApproval"),
        (lambda d: d["spec"].update(adapter="crewai"), "spec.adapter"),
        (lambda d: d.update(kind="Pod"), "kind"),
        (lambda d: d["metadata"].update(name="x" * 300), "metadata.name"),
    ],
)
def test_dict_mutations_name_the_field(mutate, field: str) -> None:
    doc = _good_doc()
    mutate(doc)
    with pytest.raises(SpecError) as err:
        parse_agentrun(doc)
    lines = str(err.value).splitlines()
    assert any(line.startswith(field + ":") for line in lines), f"{field} not named in:\n{err.value}"


def test_nul_and_lone_surrogates_in_the_spec_become_u_fffd() -> None:
    # Issue 11: stored with the documented replacement (runner/storable.py), never a crash.
    doc = _good_doc()
    doc["spec"].update(systemPrompt="a\x00b", input="refund\x00 it \udcff \ud83d\ude00")
    run = parse_agentrun(doc)
    assert run.spec.systemPrompt == "a\ufffdb"
    assert run.spec.input == "refund\ufffd it \ufffd \U0001f600"


def test_unicode_input_is_fine(tmp_path: Path) -> None:
    text = "Rückerstattung für Bestellung A-1042 🙏 — 二重請求 — طلب استرداد — e\u0301 — \U0001d54f"
    doc = _good_doc()
    doc["spec"]["input"] = text
    doc["metadata"]["name"] = "unicode-run"
    path = tmp_path / "unicode.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    run = load_agentrun(path)
    assert run.spec.input == text
    # and it survives the JSON dump the CLI stores as the run's spec
    again = parse_agentrun(run.model_dump(mode="json", exclude_none=True))
    assert again.spec.input == text


def test_an_input_over_its_limit_is_rejected_naming_spec_input(tmp_path: Path) -> None:
    doc = _good_doc()
    doc["spec"]["input"] = "refund please " * (300 * 1024 // 14 + 1)  # 300 KiB: under the file limit, over spec.input's
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError) as err:
        load_agentrun(path)
    message = str(err.value)
    assert message.startswith("spec.input:"), message
    assert "262144" in message
    assert len(message) < 500, "the error must not echo the input back"


def test_a_file_over_1_mib_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    doc = _good_doc()
    doc["spec"]["input"] = "refund please " * (2 * 1024 * 1024 // 14 + 1)
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert path.stat().st_size > 2 * 1024 * 1024
    with pytest.raises(SpecError) as err:
        load_agentrun(path)
    message = str(err.value)
    assert "larger than 1048576 bytes" in message and "huge.yaml" in message and len(message) < 500


def test_input_at_the_limit_is_accepted() -> None:
    doc = _good_doc()
    doc["spec"]["input"] = "x" * (256 * 1024)
    assert len(parse_agentrun(doc).spec.input) == 256 * 1024


def test_status_in_a_file_is_ignored_not_an_error() -> None:
    doc = _good_doc()
    doc["status"] = {"phase": "Succeeded"}
    parse_agentrun(doc)


@pytest.mark.process
def test_cli_run_of_a_bad_file_exits_2_and_registers_nothing(tmp_path: Path, dsn: str, store) -> None:
    huge = _good_doc()
    huge["metadata"]["name"] = "bad-huge-input"
    huge["spec"]["input"] = "x" * (300 * 1024)
    huge_path = tmp_path / "huge-input.yaml"
    huge_path.write_text(yaml.safe_dump(huge))

    # The ones load_agentrun passes (they used to register a run, then crash), and one of each
    # other kind; the whole table is checked in-process above.
    names = sorted(PREFLIGHT_ONLY) + [
        "unknown-tool-ref.yaml",
        "negative-budget.yaml",
        "not-yaml.yaml",
        "two-documents.yaml",
        "model-baseurl-and-script.yaml",
        "model-config-missing.yaml",
        "model-not-allowed.yaml",
    ]
    cases = {str(BAD_DIR / name): BAD[name][0] for name in names}
    cases[str(huge_path)] = "spec.input"
    # All at once: each is a separate real process; they share the (empty) database.
    procs = {path: spawn_cli("run", path, "--no-wait", dsn=dsn) for path in cases}
    failures = []
    for path, proc in procs.items():
        out, _ = proc.communicate(timeout=90)
        name = Path(path).name
        if proc.returncode != 2:
            failures.append(f"{name}: exit {proc.returncode}, want 2:\n{out}")
        elif cases[path] not in out:
            failures.append(f"{name}: {cases[path]!r} not in output:\n{out}")
        elif "Traceback" in out:
            failures.append(f"{name}: traceback:\n{out}")
    assert not failures, "\n\n".join(failures)
    assert [rec.run_id for rec, _ in store.list_runs()] == [], "a bad AgentRun was registered"


# -- issue 12: what a spec may name -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("baseURL", "http://169.254.169.254/latest/meta-data"),
        ("apiKeySecretRef", {"name": "agentfast-postgres", "key": "dsn"}),
        ("apiKeyEnv", "LD_PRELOAD"),
        ("timeoutSeconds", 5),
        ("maxRetries", 0),
    ],
)
def test_a_spec_cannot_name_an_endpoint_a_secret_or_a_variable(field: str, value) -> None:
    # Issue 12 item 4: those are a ModelConfig's (an admin's), never an AgentRun's.
    doc = _good_doc()
    doc["spec"]["model"][field] = value
    with pytest.raises(SpecError) as err:
        parse_agentrun(doc, check_imports=False)
    assert str(err.value).startswith(f"spec.model.{field}: not a field of an AgentRun"), str(err.value)
    assert "spec.model.config" in str(err.value)


def _mc_doc(**spec) -> dict:
    return {
        "apiVersion": "agentfast.dev/v1alpha1",
        "kind": "ModelConfig",
        "metadata": {"name": "llm"},
        "spec": {"baseURL": "https://api.example.com/v1", "models": ["m-1"], **spec},
    }


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"baseURL": "ftp://x/v1"}, "spec.baseURL"),
        ({"baseURL": "file:///etc/passwd"}, "spec.baseURL"),
        ({"baseURL": "http://user:pw@x/v1"}, "spec.baseURL"),
        ({"baseURL": "http://x/v1?k=1"}, "spec.baseURL"),
        ({"baseURL": "http://x/" + "a" * 2048}, "spec.baseURL"),
        ({"models": []}, "spec.models"),
        ({"models": [f"m-{i}" for i in range(65)]}, "spec.models"),
        ({"models": ["m-1", "m-1"]}, "spec.models"),
        ({"models": ["bad name"]}, "spec.models"),
        ({"apiKeySecretRef": {"name": "Bad_Name", "key": "k"}}, "spec.apiKeySecretRef.name"),
        ({"apiKeySecretRef": {"name": "a" * 254, "key": "k"}}, "spec.apiKeySecretRef.name"),
        ({"apiKeySecretRef": {"name": "s", "key": "a/b"}}, "spec.apiKeySecretRef.key"),
        ({"timeoutSeconds": 10**9}, "spec.timeoutSeconds"),
        ({"timeoutSeconds": 0}, "spec.timeoutSeconds"),
        ({"maxRetries": 10**6}, "spec.maxRetries"),
        ({"maxTokensPerRequest": 0}, "spec.maxTokensPerRequest"),
        ({"maxTokensPerRequest": 10**9}, "spec.maxTokensPerRequest"),
        ({"prices": {"promptPerMillionTokens": -1, "completionPerMillionTokens": 1}}, "spec.prices.promptPerMillionTokens"),
        ({"prices": {"promptPerMillionTokens": 1, "completionPerMillionTokens": 1e12}}, "spec.prices.completionPerMillionTokens"),
        ({"prices": {"promptPerMillionTokens": 1}}, "spec.prices.completionPerMillionTokens"),
        ({"apiKeyEnv": "LD_PRELOAD"}, "spec.apiKeyEnv"),
    ],
)
def test_modelconfig_limits_name_the_field(spec: dict, field: str) -> None:
    from agentfast.runner.spec import parse_modelconfig

    with pytest.raises(SpecError) as err:
        parse_modelconfig(_mc_doc(**spec))
    assert any(line.startswith(f"ModelConfig 'llm': {field}") for line in str(err.value).splitlines()), str(err.value)


def test_modelconfig_defaults_and_resolution() -> None:
    from agentfast.runner.spec import parse_modelconfig, resolve_model_config

    mc = parse_modelconfig(
        {
            **_mc_doc(apiKeySecretRef={"name": "llm-key", "key": "api-key"}),
            "metadata": {"name": "llm", "uid": "u-1", "resourceVersion": "42", "generation": 3},
        }
    )
    assert (mc.spec.timeoutSeconds, mc.spec.maxRetries, mc.spec.maxTokensPerRequest, mc.spec.prices) == (60.0, 4, None, None)
    doc = _good_doc()
    doc["spec"]["model"] = {"name": "m-1", "config": "llm"}
    run = resolve_model_config(parse_agentrun(doc, check_imports=False), mc)
    assert run.modelConfig is not None
    assert (run.modelConfig.name, run.modelConfig.uid, run.modelConfig.resourceVersion, run.modelConfig.generation) == (
        "llm",
        "u-1",
        "42",
        3,
    )
    assert run.modelConfig.baseURL == "https://api.example.com/v1" and run.modelConfig.apiKeySecretRef.name == "llm-key"
    # the registered document round-trips (the runner pod parses it back), and it names the Secret, never a value
    again = parse_agentrun(run.model_dump(mode="json", exclude_none=True), check_imports=False)
    assert again.modelConfig == run.modelConfig
    doc["spec"]["model"]["name"] = "m-2"
    with pytest.raises(SpecError) as err:
        resolve_model_config(parse_agentrun(doc, check_imports=False), mc)
    assert str(err.value).startswith("spec.model.name: model 'm-2' is not one ModelConfig 'llm' allows"), str(err.value)
    other_ns = parse_modelconfig({**_mc_doc(), "metadata": {"name": "llm", "namespace": "elsewhere"}})
    doc["spec"]["model"]["name"] = "m-1"
    with pytest.raises(SpecError, match="spec.model.config: ModelConfig 'llm' is in namespace 'elsewhere'"):
        resolve_model_config(parse_agentrun(doc, check_imports=False), other_ns)


def test_a_registered_document_must_agree_with_its_model_config() -> None:
    # A document whose modelConfig does not allow spec.model.name (or names another config) is refused
    # wherever it is parsed: the runner pod parses the registered document again.
    doc = _good_doc()
    doc["spec"]["model"] = {"name": "m-2", "config": "llm"}
    doc["modelConfig"] = {"name": "llm", "baseURL": "https://api.example.com/v1", "models": ["m-1"]}
    with pytest.raises(SpecError, match="spec.model.name: model 'm-2'"):
        parse_agentrun(doc, check_imports=False)
    doc["spec"]["model"] = {"name": "m-1", "config": "other"}
    with pytest.raises(SpecError, match="spec.model.config: names 'other'"):
        parse_agentrun(doc, check_imports=False)


def test_a_file_cannot_carry_the_resolved_model_config(tmp_path: Path) -> None:
    doc = _good_doc()
    doc["spec"]["model"] = {"name": "m-1", "config": "llm"}
    doc["modelConfig"] = {"name": "llm", "baseURL": "http://evil.example/v1", "models": ["m-1"]}
    path = tmp_path / "own-config.yaml"
    path.write_text(yaml.safe_dump_all([doc, _mc_doc()]))
    with pytest.raises(SpecError, match="^modelConfig: not a field of an AgentRun file"):
        load_agentrun(path)


def test_the_single_file_form_resolves_the_named_model_config(tmp_path: Path) -> None:
    doc = _good_doc()
    doc["spec"]["model"] = {"name": "m-1", "config": "llm"}
    other = {**_mc_doc(), "metadata": {"name": "other"}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump_all([other, doc, _mc_doc(maxTokensPerRequest=100)]))
    run = load_agentrun(path)
    assert run.modelConfig is not None and run.modelConfig.name == "llm" and run.modelConfig.maxTokensPerRequest == 100
    # every document is checked for aliases, not only the AgentRun
    path.write_text(
        yaml.safe_dump_all([doc]) + "---\n" + "apiVersion: agentfast.dev/v1alpha1\nkind: ModelConfig\nmetadata: {name: llm}\n"
        "spec: {baseURL: 'https://x/v1', models: &m [m-1], x: *m}\n"
    )
    with pytest.raises(SpecError, match="anchors and aliases are not accepted"):
        load_agentrun(path)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda s: s["model"].update(config="a" * 254, script=None), "spec.model.config"),
        (lambda s: s["model"].update(config="../secrets", script=None), "spec.model.config"),
        (lambda s: s["model"].update(name="x" * 257), "spec.model.name"),
        (lambda s: s["model"].update(temperature=1e300), "spec.model.temperature"),
        (lambda s: s["budget"].update(max_tokens=10**18), "spec.budget.max_tokens"),
        (lambda s: s["budget"].update(max_iterations=10**9), "spec.budget.max_iterations"),
        (lambda s: s["budget"].update(classifier="os.system; rm -rf /"), "spec.budget.classifier"),
        (lambda s: s["tools"][0].update(ref="os:system:x"), "spec.tools[0].ref"),
        (lambda s: s["tools"][0].update(ref="../../etc/passwd:x"), "spec.tools[0].ref"),
        (lambda s: s.update(approvals={"x" * 300: {"decision": "approve"}}), "spec.approvals"),
        (lambda s: s.update(approvals={"call-2-0; drop": {"decision": "approve"}}), "spec.approvals"),
        (lambda s: s.update(approvals={f"call-{i}-0": {"decision": "approve"} for i in range(129)}), "spec.approvals"),
    ],
)
def test_issue_12_limits_name_the_field(mutate, field: str) -> None:
    doc = _good_doc()
    mutate(doc["spec"])
    doc["spec"]["model"] = {k: v for k, v in doc["spec"]["model"].items() if v is not None}
    with pytest.raises(SpecError) as err:
        parse_agentrun(doc, check_imports=False)
    assert any(line.startswith(field) for line in str(err.value).splitlines()), str(err.value)


def test_call_id_keys_and_long_names_are_accepted() -> None:
    doc = _good_doc()
    doc["metadata"]["name"] = "a" * 253
    doc["spec"]["approvals"] = {
        "call-2-0": {"decision": "approve", "decidedBy": "alice"},
        "call-1-0-rerun1": {"decision": "deny", "reason": "no", "decidedBy": "alice"},
    }
    assert len(parse_agentrun(doc).spec.approvals) == 2


def test_a_gate_can_be_added_never_removed() -> None:
    from agentfast.runner.tools import ToolRegistry

    doc = _good_doc()
    doc["spec"]["tools"][1]["requiresApproval"] = False  # issue_refund is declared requires_approval=True
    with pytest.raises(SpecError) as err:
        ToolRegistry.from_agentrun(parse_agentrun(doc))  # what the tool host builds before any call
    assert str(err.value).startswith("spec.tools[1].requiresApproval:") and "never remove" in str(err.value)
    doc = _good_doc()
    doc["spec"]["tools"][0]["requiresApproval"] = True
    assert ToolRegistry.from_agentrun(parse_agentrun(doc)).get("lookup_order").requires_approval is True


def test_yaml_aliases_are_refused_before_they_expand(tmp_path: Path) -> None:
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 20)]  # 10**20 strings once expanded
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecError) as err:
        load_agentrun(path)
    assert "anchors and aliases are not accepted" in str(err.value) and "line 1" in str(err.value)
    one = tmp_path / "one-alias.yaml"
    doc = yaml.safe_dump(_good_doc()).replace("input:", "x-base: &base {}\ninput:", 1)
    one.write_text(doc)
    with pytest.raises(SpecError):
        load_agentrun(one)


def test_resolve_ref_turns_any_base_exception_into_import_error(tmp_path: Path, monkeypatch) -> None:
    from agentfast.runner.spec import resolve_ref

    for i, exc in enumerate(("SystemExit(0)", "KeyboardInterrupt()", "GeneratorExit()", "MemoryError('x' * 100)")):
        (tmp_path / f"raises_{i}.py").write_text(f"raise {exc}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for i, name in enumerate(("SystemExit", "KeyboardInterrupt", "GeneratorExit", "MemoryError")):
        with pytest.raises(ImportError) as err:
            resolve_ref(f"raises_{i}:x")
        assert str(err.value) == f"importing module 'raises_{i}' raised {name}"


@pytest.mark.parametrize(
    "value,problem",
    [(0, "greater than or equal to 1"), (31_536_001, "less than or equal to 31536000"), ("soon", "valid integer")],
)
def test_a_deadline_is_whole_seconds_from_1_to_a_year(value: object, problem: str) -> None:
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    doc["spec"]["activeDeadlineSeconds"] = value
    with pytest.raises(SpecError, match=rf"spec.activeDeadlineSeconds: .*{problem}"):
        parse_agentrun(doc, check_imports=False)
    doc["spec"]["activeDeadlineSeconds"] = 3600
    assert parse_agentrun(doc, check_imports=False).spec.activeDeadlineSeconds == 3600


@pytest.mark.process
def test_a_file_cannot_ask_to_cancel_a_run(tmp_path: Path) -> None:
    doc = yaml.safe_load((EXAMPLES / "refund.yaml").read_text())
    doc["spec"]["cancel"] = True
    assert parse_agentrun(doc, check_imports=False).spec.cancel is True  # a field of the resource (the CRD's)
    path = tmp_path / "cancelled.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = spawn_cli("run", str(path), dsn="postgresql://nobody@127.0.0.1:1/none")  # refused before any store is opened
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "spec.cancel is never read from a file" in out and "agentfast cancel" in out, out
