"""The pages' calculators in Chromium: window.handbookCalc equals reference_impl.calc.

Each JavaScript calculator runs on a few hundred random valid inputs (fixed seed), all in
one `page.evaluate` per calculator, and must return the Python twin's keys with every
number within 1e-9 relative error; bad inputs must throw the Python ValueError's message.
One form is then driven like a user would, in light and dark mode.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import random
import re
from pathlib import Path

import pytest
from calc_inputs import log_uniform, maybe, memory_inputs
from handbook_pdf import new_context
from test_calc import BAD_INPUTS
from test_site_in_chromium import Problems, _new_page

from reference_impl import calc

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(240)]

CASES = 250
PLAYBOOK = "reference/calculators/"  # every form, with its presets
RUN_ALL = """
(cases) => cases.map(([name, inputs]) => {
  try { return {result: window.handbookCalc[name](inputs)}; }
  catch (err) { return {error: String(err && err.message)}; }
})
"""


def _ring_allreduce(rng: random.Random) -> dict:
    return maybe(rng, {"size_bytes": log_uniform(rng, 1e3, 1e12), "world_size": rng.randint(2, 100_000),
                        "bandwidth_bytes_per_s": log_uniform(rng, 1e8, 1e13)},
                  latency_s=rng.choice([0.0, log_uniform(rng, 1e-7, 1e-3)]))


def _fsdp_comm(rng: random.Random) -> dict:
    return maybe(rng, {"params": log_uniform(rng, 1e5, 2e12), "world_size": rng.randint(2, 100_000),
                        "bandwidth_bytes_per_s": log_uniform(rng, 1e8, 1e13)},
                  param_bytes=rng.choice([1, 2, 4]), grad_bytes=rng.choice([1, 2, 4]),
                  reshard_after_forward=rng.random() < 0.5)


def _tp_comm(rng: random.Random) -> dict:
    return maybe(rng, {"seq_len": rng.randint(1, 131_072), "micro_batch": rng.randint(1, 64),
                        "hidden": rng.randint(1, 65_536), "n_layers": rng.randint(1, 160),
                        "tp_degree": rng.randint(2, 64), "bandwidth_bytes_per_s": log_uniform(rng, 1e8, 1e13)},
                  activation_bytes=rng.choice([1, 2, 4]))


def _pp_comm(rng: random.Random) -> dict:
    return maybe(rng, {"seq_len": rng.randint(1, 131_072), "micro_batch": rng.randint(1, 64),
                        "hidden": rng.randint(1, 65_536), "stages": rng.choice([2, 3, rng.randint(2, 128)]),
                        "bandwidth_bytes_per_s": log_uniform(rng, 1e8, 1e13)},
                  activation_bytes=rng.choice([1, 2, 4]))


def _moe_all_to_all(rng: random.Random) -> dict:
    return maybe(rng, {"tokens": rng.randint(1, 131_072), "hidden": rng.randint(1, 65_536),
                        "top_k": rng.choice([1, 2, rng.randint(1, 8)]),
                        "ep_degree": rng.choice([2, rng.randint(2, 256)]),
                        "bandwidth_bytes_per_s": log_uniform(rng, 1e8, 1e13)},
                  activation_bytes=rng.choice([1, 2, 4]))


def _pipeline_bubble(rng: random.Random) -> dict:
    stages, interleave = rng.randint(1, 64), rng.choice([1, 1, 2, 3, 4, 8])
    schedule = rng.choice(["1f1b", "1f1b", "zero_bubble", "zbv"])
    if schedule == "zbv":
        return {"stages": stages, "microbatches": rng.randint(1, 256), "interleave": 2, "schedule": schedule}
    if schedule == "zero_bubble":
        return {"stages": stages, "microbatches": stages * rng.randint(1, 64), "interleave": interleave,
                "schedule": schedule}
    if interleave == 1:
        return maybe(rng, {"stages": stages, "microbatches": rng.randint(1, 1024)}, interleave=1, schedule="1f1b")
    return {"stages": stages, "microbatches": stages * rng.randint(1, 64), "interleave": interleave}


def _checkpoint_interval(rng: random.Random) -> dict:
    mtbf = log_uniform(rng, 10, 1e7)
    cost = rng.choice([
        log_uniform(rng, 1e-6 * mtbf, 0.5 * mtbf), log_uniform(rng, 1e-6 * mtbf, 0.5 * mtbf),
        log_uniform(rng, 1e-3 * mtbf, 50 * mtbf),
        2 * mtbf,  # the edge of Daly's formula: both twins must pick the same branch
    ])
    return maybe(rng, {"checkpoint_cost_s": cost, "mtbf_s": mtbf},
                  restart_s=rng.uniform(0, 50 * mtbf) if rng.random() < 0.2 else rng.uniform(0, 0.1 * mtbf))


def _mfu(rng: random.Random) -> dict:
    return {"flops_per_sample": log_uniform(rng, 1e6, 1e16), "samples_per_step": rng.choice(
        [rng.randint(1, 100_000), rng.uniform(0.5, 1e5)]), "step_time_s": log_uniform(rng, 1e-3, 1e3),
        "n_gpus": rng.randint(1, 100_000), "peak_flops_per_gpu": log_uniform(rng, 1e12, 1e16)}


def _step_time(rng: random.Random) -> dict:
    inputs = _mfu(rng)
    del inputs["step_time_s"]
    return {**inputs, "mfu": rng.uniform(1e-3, 1.0)}


def _goodput(rng: random.Random) -> dict:
    n_gpus = rng.choice([1, 8, rng.randint(1, 200_000)])
    mtbf = log_uniform(rng, 1, 1e7) * n_gpus / 3600  # a job MTBF from 1 s to 4 months
    job = mtbf * 3600 / n_gpus
    save = rng.choice([log_uniform(rng, 1e-7 * job, 0.5 * job), log_uniform(rng, 1e-3 * job, 100 * job),
                       2 * job])
    return maybe(rng, {"n_gpus": n_gpus, "mtbf_gpu_hours": mtbf, "save_s": save,
                        "restart_s": rng.choice([0.0, rng.uniform(0, 100 * job), rng.uniform(0, 0.1 * job)])},
                  interval_s=rng.choice([None, log_uniform(rng, 1e-6 * job, 100 * job)]))


GENERATORS = {"memory": memory_inputs, "ring_allreduce": _ring_allreduce, "fsdp_comm": _fsdp_comm,
              "tp_comm": _tp_comm, "pp_comm": _pp_comm, "moe_all_to_all": _moe_all_to_all,
              "pipeline_bubble": _pipeline_bubble,
              "checkpoint_interval": _checkpoint_interval, "mfu": _mfu, "step_time": _step_time,
              "goodput": _goodput}


@pytest.fixture(scope="module")
def page(browser, server):
    context, page = _new_page(browser)
    problems = Problems(page)
    page.goto(server + PLAYBOOK, wait_until="load")
    page.wait_for_function("() => window.handbookCalc !== undefined")
    yield page
    context.close()
    assert not problems.items, "\n".join(problems.items)


def test_every_calculator_has_a_python_twin_and_a_page() -> None:
    """The contract both ways: the same names in reference_impl.calc, calculators.js and the pages."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    script = (docs / "javascripts" / "calculators.js").read_text(encoding="utf-8")
    exported = re.search(r"window\.handbookCalc = \{(?P<body>[^}]*)\}", script)["body"]
    js_names = set(re.findall(r"(\w+):", exported))
    on_pages = {m for p in docs.rglob("*.md") for m in re.findall(r'data-calc="(\w+)"', p.read_text("utf-8"))}
    assert js_names == set(GENERATORS) == on_pages
    assert all(callable(getattr(calc, name)) for name in js_names)


def _close(js: object, py: object) -> bool:
    if isinstance(py, bool) or isinstance(py, str):
        return js == py
    return isinstance(js, (int, float)) and not isinstance(js, bool) and math.isclose(js, py, rel_tol=1e-9)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_browser_twin_matches_python(page, name: str) -> None:
    rng = random.Random(f"handbook-calc-{name}")
    cases = [GENERATORS[name](rng) for _ in range(CASES)]
    expected = [getattr(calc, name)(**inputs) for inputs in cases]  # all valid: none raises
    answers = page.evaluate(RUN_ALL, [[name, inputs] for inputs in cases])
    mismatches = []
    for inputs, py, js in zip(cases, expected, answers):
        if "error" in js:
            mismatches.append(f"{inputs}: JavaScript threw {js['error']!r}")
        elif set(js["result"]) != set(py):
            mismatches.append(f"{inputs}: keys {sorted(js['result'])} != {sorted(py)}")
        else:
            bad = {k: (js["result"][k], v) for k, v in py.items() if not _close(js["result"][k], v)}
            if bad:
                mismatches.append(f"{inputs}: (js, py) {bad}")
    assert not mismatches, f"{len(mismatches)} of {CASES} differ:\n" + "\n".join(mismatches[:10])


# calc.memory's parts in reference_impl.calc: the functions named memory_<part> (memory itself aside).
MEMORY_PARTS = sorted(name for name in vars(calc) if name.startswith("memory_") and callable(getattr(calc, name)))
RUN_PARTS = """
([names, cases]) => cases.map((inputs) => {
  const parts = window.handbookCalcMemoryParts, m = parts.memory_inputs(inputs), out = {};
  for (const name of names) out[name] = name === "memory_inputs" ? m : parts[name](m);
  return out;
})
"""


def _python_part(name: str, m: calc.MemoryInputs) -> object:
    """A part's answer as JSON carries it; for `memory_inputs`, the record and its properties."""
    if name == "memory_inputs":
        return {**dataclasses.asdict(m), **{key: getattr(m, key) for key, value in vars(calc.MemoryInputs).items()
                                            if isinstance(value, property)}}
    return json.loads(json.dumps(getattr(calc, name)(m)))


def _same(js: object, py: object) -> bool:
    """Equal structure, and every number within the twins' 1e-9."""
    if isinstance(py, dict):
        return isinstance(js, dict) and set(js) == set(py) and all(_same(js[k], v) for k, v in py.items())
    if isinstance(py, list):
        return isinstance(js, list) and len(js) == len(py) and all(map(_same, js, py))
    if py is None:
        return js is None
    return _close(js, py)


def test_each_part_of_memory_matches_python(page) -> None:
    """Not only the total: each named part of `calc.memory` (model state, the attention's,
    MLP's and norms' activations, the stored ones, the loss's and the blocks' moments, the
    peak) returns the same structure and numbers in JavaScript, on every random input."""
    assert set(page.evaluate("() => Object.keys(window.handbookCalcMemoryParts)")) == set(MEMORY_PARTS)
    rng = random.Random("handbook-calc-memory-parts")
    signature = inspect.signature(calc.memory)
    cases = []
    for _ in range(CASES):
        bound = signature.bind(**memory_inputs(rng))
        bound.apply_defaults()
        cases.append(bound.arguments)
    answers = page.evaluate(RUN_PARTS, [MEMORY_PARTS, cases])
    differing = {}
    for inputs, js in zip(cases, answers, strict=True):
        m = calc.memory_inputs(inputs)
        for name in MEMORY_PARTS:
            py = _python_part(name, m)
            if not _same(js[name], py):
                differing.setdefault(name, f"{inputs}: (js, py) {js[name]}, {py}")
    assert not differing, "parts that differ, each with its first input:\n" + "\n".join(
        f"{name}: {first}" for name, first in differing.items())


def test_bad_inputs_throw_the_python_message(page) -> None:
    cases = BAD_INPUTS + [("ring_allreduce", {"size_bytes": 1e9, "world_size": 4}, None),
                          ("pipeline_bubble", {"stages": 4, "microbatches": 8, "stage": 2}, None),
                          ("pipeline_bubble", {"stages": 4, "microbatches": 8, "schedule": "ZB"}, None),
                          ("pipeline_bubble", {"stages": 4, "microbatches": 8, "schedule": "zbv"}, None),
                          ("pipeline_bubble", {"stages": 4, "microbatches": 6, "schedule": "zero_bubble"}, None),
                          ("pipeline_bubble", {"stages": 4, "microbatches": 6, "interleave": 2, "schedule": "zbv",
                                               "extra": 1}, None)]
    answers = page.evaluate(RUN_ALL, [[name, inputs] for name, inputs, _ in cases])
    for (name, inputs, _), js in zip(cases, answers):
        with pytest.raises((ValueError, TypeError)) as python:  # TypeError: a missing or unknown input
            getattr(calc, name)(**inputs)
        assert "error" in js, f"{name}({inputs}) returned {js} instead of throwing"
        if python.type is ValueError:
            # The messages agree up to the offending value, which each language prints its way.
            assert js["error"].split(", got")[0] == str(python.value).split(", got")[0]
        else:
            assert re.search(r"(missing required|unexpected) input '\w+'", js["error"]), js["error"]


def _shown(form, key: str) -> str:
    """The text a reader sees in an output; read on screen, since text off screen is not laid out."""
    output = form.locator(f'output[data-output="{key}"]')
    output.scroll_into_view_if_needed()
    # The browser draws a block that came near the screen at its next frame.
    output.evaluate("(el) => new Promise((drawn) => { const check = () => "
                    "el.checkVisibility({contentVisibilityAuto: true}) ? drawn() : requestAnimationFrame(check); "
                    "check(); })")
    return output.inner_text()


def test_a_user_fills_the_ring_allreduce_form(browser, server) -> None:
    context, page = _new_page(browser)
    problems = Problems(page)
    try:
        page.goto(server + PLAYBOOK, wait_until="load")
        form = page.locator('.handbook-calc[data-calc="ring_allreduce"]')
        form.get_by_label("Size reduced (GB)").fill("4")
        form.get_by_label("Ranks N").fill("16")
        form.get_by_label("Bandwidth per rank (GB/s)").fill("25")
        form.get_by_label("Latency per step (µs)").fill("10")
        python = calc.ring_allreduce(size_bytes=4e9, world_size=16, bandwidth_bytes_per_s=25e9, latency_s=10e-6)
        assert _shown(form, "bytes_per_rank") == "7.50 GB" == f"{python['bytes_per_rank'] / 1e9:.2f} GB"
        assert _shown(form, "steps") == "30" == str(python["steps"])
        assert _shown(form, "time_s") == f"{python['time_s'] * 1e3:.0f} ms" == "300 ms"
        # A bad value replaces the result with the calculator's own message.
        form.get_by_label("Ranks N").fill("1")
        assert form.get_by_role("alert").inner_text() == "Ranks N must be a whole number ≥ 2"
        assert not form.locator("table").is_visible()
        form.get_by_label("Ranks N").fill("2")
        assert not form.get_by_role("alert").is_visible()
        assert _shown(form, "bytes_per_rank") == "4.00 GB"
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)


def _more_inputs(form) -> None:
    """Unfold a form's advanced inputs, as a reader does to reach them."""
    form.get_by_text("More inputs").click()


def test_the_goodput_form_prices_the_optimum_when_the_interval_is_empty(browser, server) -> None:
    context, page = _new_page(browser)
    problems = Problems(page)
    try:
        page.goto(server + "reliability/failure-model/", wait_until="load")
        form = page.locator('.handbook-calc[data-calc="goodput"]')
        best = calc.goodput(n_gpus=16384, mtbf_gpu_hours=45567, save_s=30, restart_s=600)
        assert _shown(form, "goodput") == f"{100 * best['goodput']:.1f}%" == "87.2%"
        assert _shown(form, "interval_s") == _shown(form, "optimal_interval_s") == "12.6 min"
        form.get_by_label("Interval between saves (min; empty: optimum)").fill("5")
        fixed = calc.goodput(n_gpus=16384, mtbf_gpu_hours=45567, save_s=30, restart_s=600, interval_s=300)
        assert _shown(form, "interval_s") == "5.00 min"
        assert _shown(form, "goodput") == f"{100 * fixed['goodput']:.1f}%" != f"{100 * best['goodput']:.1f}%"
        form.get_by_label("Interval between saves (min; empty: optimum)").fill("")
        assert _shown(form, "interval_s") == "12.6 min"
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)


def _open(browser, url: str, width: int = 1280, height: int = 900):
    context = new_context(browser, viewport={"width": width, "height": height})
    page = context.new_page()
    page.set_default_timeout(20_000)
    problems = Problems(page)
    page.goto(url, wait_until="load")
    page.wait_for_function("() => window.handbookCalc !== undefined")
    return context, page, problems


def test_errors_speak_the_forms_words_and_units(browser, server) -> None:
    context, page, problems = _open(browser, server + PLAYBOOK)
    try:
        form = page.locator('.handbook-calc[data-calc="memory"]')
        params = form.get_by_label("Parameters (billions)")
        params.fill("-1000")
        assert form.get_by_role("alert").inner_text() == "Parameters (billions) must be positive"
        assert params.get_attribute("aria-invalid") == "true"
        assert not form.locator("table").is_visible()
        params.fill("")
        assert form.get_by_role("alert").inner_text() == "Parameters (billions) must be a number"
        params.fill("7")
        assert not form.get_by_role("alert").is_visible() and params.get_attribute("aria-invalid") is None
        form.get_by_label("Attention heads").fill("33")
        assert form.get_by_role("alert").inner_text() == "Hidden size (4096) must be a multiple of Attention heads (33)"
        form.get_by_label("Attention heads").fill("32")
        _more_inputs(form)
        form.get_by_label("Gradient accumulation steps").fill("0")
        assert form.get_by_role("alert").inner_text() == "Gradient accumulation steps must be a whole number ≥ 1"
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)
    # A shown unit other than the calculator's: the limit is given in the form's percent.
    context, page, problems = _open(browser, server + "reliability/performance/")
    try:
        form = page.locator('.handbook-calc[data-calc="step_time"]')
        form.get_by_label("Assumed MFU (%)").fill("150")
        assert form.get_by_role("alert").inner_text() == "Assumed MFU (%) must be at most 100"
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)


def test_implausible_results_are_flagged_not_printed(browser, server) -> None:
    context, page, problems = _open(browser, server + "reliability/performance/")
    try:
        form = page.locator('.handbook-calc[data-calc="mfu"]')
        form.get_by_label("Measured step time (s)").fill("0.1")
        python = calc.mfu(flops_per_sample=172.032e12, samples_per_step=256, step_time_s=0.1, n_gpus=64,
                          peak_flops_per_gpu=989e12)
        assert python["mfu"] > 1
        assert "%" not in _shown(form, "mfu") and "TFLOP" not in _shown(form, "achieved_flops_per_gpu")
        assert "above 100%" in form.locator(".handbook-calc__warning").inner_text()
        form.get_by_label("Measured step time (s)").fill("2")
        assert _shown(form, "mfu").endswith("%") and not form.locator(".handbook-calc__warning").is_visible()
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)
    context, page, problems = _open(browser, server + "reliability/checkpointing/")
    try:
        form = page.locator('.handbook-calc[data-calc="checkpoint_interval"]')
        form.get_by_label("Job MTBF M (hours)").fill("0.01")
        python = calc.checkpoint_interval(checkpoint_cost_s=30, mtbf_s=36, restart_s=60)
        assert python["daly_overhead_fraction"] > 1
        assert "%" not in _shown(form, "daly_overhead_fraction")
        assert "above 100%" in form.locator(".handbook-calc__warning").inner_text()
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)
    context, page, problems = _open(browser, server + PLAYBOOK)
    try:
        form = page.locator('.handbook-calc[data-calc="memory"]')
        form.scroll_into_view_if_needed()  # as a reader would: text off screen is not laid out
        form.get_by_label("Preset").select_option("Llama 3 405B on 16,384 GPUs")
        form.get_by_label("Strategy").select_option("ddp")
        assert "GB" not in _shown(form, "total_bytes")
        assert "GB" not in form.locator("output[data-headline]").inner_text()
        assert "largest accelerator" in form.locator(".handbook-calc__warning").inner_text()
        form.get_by_label("Strategy").select_option("fsdp")
        form.get_by_label("Data-parallel GPUs N").fill("512")
        form.get_by_label("Activation recompute").select_option("full")
        assert _shown(form, "total_bytes").endswith(" GB") and not form.locator(".handbook-calc__warning").is_visible()
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)


# The headline output's key and its text, or null for a form without one (or flagged).
HEADLINE = """(host) => {
  const out = host.querySelector("output[data-headline]");
  return out && out.offsetParent ? [out.dataset.headline, out.textContent] : null;
}"""
# How the form writes `value` for output `key` of calculator `name` (the same formatter).
FORMAT_ONE = """([name, key, value]) => window.handbookCalcFormat(name, key, value)"""
FORM_INPUTS = """(host) => {
  const values = {};
  for (const el of host.querySelectorAll("input, select")) {
    values[el.name] = el.type === "checkbox" ? el.checked : el.value;
  }
  return values;
}"""


def test_a_preset_fills_every_form_with_its_inputs(browser, server) -> None:
    """Each form offers the presets of docs/javascripts/calculator_presets.json that name it;
    picking one shows each of its inputs in the field's unit (tests/test_calculator_presets.py
    runs the same inputs through the Python twins), and the result is the Python twin's."""
    table = json.loads((Path(__file__).resolve().parents[2] / "docs" / "javascripts" /
                        "calculator_presets.json").read_text(encoding="utf-8"))["presets"]
    context, page, problems = _open(browser, server + PLAYBOOK)
    try:
        fields = page.evaluate("() => window.handbookCalcFields")
        page.wait_for_function("() => window.handbookCalcPresets !== undefined")
        assert {p["name"] for p in page.evaluate("() => window.handbookCalcPresets")} == {p["name"] for p in table}
        assert page.locator(".handbook-calc-presets dt").count() == len(table)
        for name in sorted(fields):
            form = page.locator(f'.handbook-calc[data-calc="{name}"]')
            form.scroll_into_view_if_needed()
            host = form.element_handle()
            offered = [p for p in table if name in p["inputs"]]
            assert offered, f"{name}: no preset"
            assert form.get_by_label("Preset").locator("option").all_inner_texts() == \
                ["Custom"] + [p["name"] for p in offered]
            for preset in offered:
                inputs = preset["inputs"][name]
                form.get_by_label("Preset").select_option(preset["name"])
                shown = page.evaluate(FORM_INPUTS, host)
                for key, _label, kind, _default, *scale in fields[name]:
                    if isinstance(kind, dict):  # a choice that sets several inputs
                        assert kind[shown[key]] == {k: inputs.get(k, False) for k in kind[shown[key]]}, (preset, key)
                    elif kind == "check" or isinstance(kind, list):
                        assert shown[key] == inputs[key], (preset["name"], name, key)
                    elif inputs[key] is None:  # an "optional" input left out: its box is empty
                        assert kind == "optional" and shown[key] == "", (preset["name"], name, key, shown[key])
                    else:
                        assert float(shown[key]) * (scale[0] if scale else 1) == pytest.approx(inputs[key], rel=1e-9), \
                            (preset["name"], name, key, shown[key])
                headline = page.evaluate(HEADLINE, host)
                if headline is not None:
                    key, text = headline
                    value = getattr(calc, name)(**inputs)[key]
                    assert text == page.evaluate(FORMAT_ONE, [name, key, value]), (preset["name"], name, text)
        # Editing a field a preset set makes the form a custom one.
        form = page.locator('.handbook-calc[data-calc="memory"]')
        form.get_by_label("Layers").fill("3")
        assert form.get_by_label("Preset").input_value() == ""
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)


# Resolves once the element has kept its place on screen for three frames: blocks that come
# near the screen are drawn at the next frame, and each may resize and move what follows it.
SETTLED = ("(el) => new Promise((done) => { let last = null, same = 0, frames = 0;"
           " const check = () => { const top = el.getBoundingClientRect().top;"
           " same = top === last ? same + 1 : 0; last = top;"
           " if (same >= 3 || ++frames > 120) done(); else requestAnimationFrame(check); }; check(); })")


def test_on_a_phone_the_result_stays_beside_the_edited_field(browser, server) -> None:
    """At 390 x 844 the memory form is taller than the screen: its headline result stays in view."""
    context, page, problems = _open(browser, server + PLAYBOOK, width=390, height=844)
    try:
        form = page.locator('.handbook-calc[data-calc="memory"]')
        summary = form.locator(".handbook-calc__summary")
        _more_inputs(form)
        assert form.bounding_box()["height"] > 844  # the case that needs it
        for label, value in (("Parameters (billions)", "70"), ("Layers", "80"), ("Gradient accumulation steps", "4"),
                             ("Parameters (billions)", "-1")):
            field = form.get_by_label(label, exact=True)
            field.scroll_into_view_if_needed()
            field.evaluate(SETTLED)  # where the reader sees it once the text around it is drawn
            field.fill(value)
            field.evaluate(SETTLED)
            box, at = summary.bounding_box(), field.bounding_box()
            assert 0 <= box["y"] and box["y"] + box["height"] <= 844, (label, box)
            assert 0 <= at["y"] and at["y"] + at["height"] <= box["y"], (label, at, box)  # visible, not covered
        assert summary.get_by_role("alert").inner_text() == "Parameters (billions) must be positive"
        form.get_by_label("Parameters (billions)").fill("70")
        assert summary.locator("output[data-headline]").inner_text().endswith(" GB")
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)


def _rgba(css: str) -> tuple[float, float, float, float]:
    r, g, b, *alpha = (float(v) for v in re.findall(r"[\d.]+", css))
    return r, g, b, alpha[0] if alpha else 1.0


def _over(top: str, below: tuple[float, float, float]) -> tuple[float, float, float]:
    """Composite a possibly translucent colour over an opaque one (Material's greys are rgba)."""
    *rgb, a = _rgba(top)
    return tuple(a * c + (1 - a) * u for c, u in zip(rgb, below))


def _luminance(rgb: tuple[float, float, float]) -> float:
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in (v / 255 for v in rgb)]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def _contrast(colours: list[str]) -> float:
    """WCAG contrast of text colour over its background over the page background."""
    text, background, page = colours
    base = _over(background, _rgba(page)[:3])
    hi, lo = sorted((_luminance(_over(text, base)), _luminance(base)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


# The text colour of an element, the background it sits on (its own, if it has one, else
# the calculator's), and the page's.
COLOURS = """(sel) => {
  const el = document.querySelector(sel), own = getComputedStyle(el).backgroundColor;
  const host = getComputedStyle(el.closest(".handbook-calc")).backgroundColor;
  return [getComputedStyle(el).color, own === "rgba(0, 0, 0, 0)" ? host : own,
          getComputedStyle(document.body).backgroundColor];
}"""
# A focused field's outline colour, the calculator's background it is drawn on, the page's.
RING = """(sel) => {
  const el = document.querySelector(sel);
  el.focus();
  const style = getComputedStyle(el);
  return [style.outlineStyle, [style.outlineColor, getComputedStyle(el.closest(".handbook-calc")).backgroundColor,
          getComputedStyle(document.body).backgroundColor]];
}"""


def test_forms_are_readable_in_light_and_dark_mode_and_after_instant_navigation(browser, server) -> None:
    context, page = _new_page(browser)
    problems = Problems(page)
    try:
        page.goto(server, wait_until="load")
        # Arrive by clicks: Material swaps the page in without reloading the script.
        page.locator(".md-tabs a", has_text="Reliability").first.click()
        page.locator(".md-nav a:visible", has_text="Performance model").first.click()
        page.wait_for_url("**/reliability/performance/")
        form = page.locator('.handbook-calc[data-calc="mfu"]')
        form.locator("output[data-output=mfu]").wait_for()
        python = calc.mfu(flops_per_sample=172.032e12, samples_per_step=256, step_time_s=2, n_gpus=64,
                          peak_flops_per_gpu=989e12)
        assert _shown(form, "mfu") == f"{100 * python['mfu']:.1f}%"
        schemes = []
        for _ in range(2):
            schemes.append(page.evaluate("() => document.body.getAttribute('data-md-color-scheme')"))
            for part in ("input", "output", "label", "p"):
                colours = page.evaluate(COLOURS, f'.handbook-calc[data-calc="mfu"] {part}')
                assert _contrast(colours) >= 4.5, f"{schemes[-1]}: {part} {colours}"
            outline, colours = page.evaluate(RING, '.handbook-calc[data-calc="mfu"] input')
            assert outline != "none" and _contrast(colours) >= 3, f"{schemes[-1]}: focus ring {colours}"
            form.get_by_label("GPUs").fill("0")
            colours = page.evaluate(COLOURS, '.handbook-calc[data-calc="mfu"] [role=alert]')
            assert _contrast(colours) >= 4.5, f"{schemes[-1]}: error message {colours}"
            form.get_by_label("GPUs").fill("64")
            page.locator("form[data-md-component=palette] label:visible").first.click()
            page.wait_for_function(f"() => document.body.getAttribute('data-md-color-scheme') !== {schemes[-1]!r}")
        assert set(schemes) == {"default", "slate"}
    finally:
        context.close()
    assert not problems.items, "\n".join(problems.items)
