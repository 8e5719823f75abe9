/*
 * The handbook's calculators: the browser twins of reference_impl/calc/ (one module per topic).
 *
 * window.handbookCalc.<name>(inputs) takes an object with the same keys as the Python
 * function's keyword arguments, applies the same defaults, and returns an object with the
 * same keys as the Python dict; tests/browser/test_calculators.py compares the two on
 * hundreds of random inputs. A bad input THROWS an Error whose message is the Python
 * ValueError's (a missing or unknown key throws too, as Python's TypeError would); the
 * forms catch it and show it instead of a result, in their own words: the field's label
 * and shown unit in place of the input's name.
 *
 * Each <div class="handbook-calc" data-calc="NAME"> on a page gets a form for NAME that
 * recomputes on every keystroke, keeps its headline result in view beside the fields, and
 * flags a result no machine can reach instead of printing it. Plain JavaScript, no
 * dependencies: the site works offline.
 */
(function () {
  "use strict";

  var STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"];
  var GRAD_SYNCS = ["last", "every"];
  var PIPELINE_SCHEDULES = ["1f1b", "zero_bubble", "zbv"];
  var MAX_COST_OVER_MTBF = 100;

  // ------------------------------------------------------------ validation (as calc/checks.py)

  function repr(value) {
    return typeof value === "string" ? "'" + value + "'" : String(value);
  }

  function number(name, value) {
    if (typeof value !== "number" || !Number.isFinite(value)) {
      throw new Error(name + " must be a finite number, got " + repr(value));
    }
    return value;
  }

  function positive(name, value) {
    if (number(name, value) <= 0) throw new Error(name + " must be positive, got " + repr(value));
    return value;
  }

  function nonNegative(name, value) {
    if (number(name, value) < 0) throw new Error(name + " must not be negative, got " + repr(value));
    return value;
  }

  function count(name, value, minimum) {
    minimum = minimum === undefined ? 1 : minimum;
    if (number(name, value) !== Math.floor(value) || value < minimum) {
      throw new Error(name + " must be a whole number >= " + minimum + ", got " + repr(value));
    }
    return value;
  }

  function flag(name, value) {
    if (typeof value !== "boolean") throw new Error(name + " must be true or false, got " + repr(value));
    return value;
  }

  // Python's keyword-only signature, spelled out: required keys, then defaults.
  function bind(fn, inputs, required, defaults) {
    if (inputs === null || typeof inputs !== "object") throw new Error(fn + "() takes an object of inputs");
    var args = {};
    Object.keys(inputs).forEach(function (key) {
      if (required.indexOf(key) < 0 && !(key in defaults)) {
        throw new Error(fn + "() got an unexpected input '" + key + "'");
      }
      args[key] = inputs[key];
    });
    required.forEach(function (key) {
      if (!(key in args)) throw new Error(fn + "() missing required input '" + key + "'");
    });
    Object.keys(defaults).forEach(function (key) {
      if (!(key in args)) args[key] = defaults[key];
    });
    return args;
  }

  // ------------------------------------------------------------ memory, part by part (as calc/memory_model.py)

  // Each memory_* function is the twin of calc/memory_model.py's of the same name and takes the record
  // memory_inputs returns; tests/browser/test_calculators.py compares them part by part.
  var MODEL_STATES = ["params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes"];

  function copyOf(object) {
    var out = {};
    Object.keys(object).forEach(function (key) { out[key] = object[key]; });
    return out;
  }

  // The sum of an object's values in their order (Python's sum(d.values())).
  function total(object) {
    return Object.keys(object).reduce(function (sum, key) { return sum + object[key]; }, 0);
  }

  // Every input given (memory binds the defaults), checked in calc/memory_model.py's order; the record
  // also carries MemoryInputs' properties.
  function memory_inputs(x) {
    var p = positive("params", x.params), n = count("world_size", x.world_size);
    if (STRATEGIES.indexOf(x.strategy) < 0) {
      throw new Error("strategy must be one of " + STRATEGIES.join(", ") + ", got " + repr(x.strategy));
    }
    var s = count("seq_len", x.seq_len), b = count("micro_batch", x.micro_batch);
    var h = count("hidden", x.hidden), a = count("n_heads", x.n_heads), layers = count("n_layers", x.n_layers);
    if (h % a) throw new Error("hidden (" + h + ") must be a multiple of n_heads (" + a + ")");
    var checkpointing = flag("activation_checkpointing", x.activation_checkpointing);
    var scores = flag("stores_attention_scores", x.stores_attention_scores);
    var weights = positive("param_bytes", x.param_bytes), grads = nonNegative("grad_bytes", x.grad_bytes);
    var master = nonNegative("master_bytes", x.master_bytes);
    var moments = nonNegative("optimizer_bytes", x.optimizer_bytes);
    var f = x.ffn_hidden === null ? 4 * h : count("ffn_hidden", x.ffn_hidden);
    var gated = flag("gated_mlp", x.gated_mlp);
    var kvHeads = x.n_kv_heads === null ? a : count("n_kv_heads", x.n_kv_heads);
    var vocab = count("vocab_size", x.vocab_size, 0);
    var t = count("tp_degree", x.tp_degree), pp = count("pp_degree", x.pp_degree);
    var cp = count("cp_degree", x.cp_degree);
    var sp = flag("sequence_parallel", x.sequence_parallel), c = positive("compute_bytes", x.compute_bytes);
    var peak = flag("transients", x.transients), selective = flag("selective_recompute", x.selective_recompute);
    var offload = flag("offload_optimizer", x.offload_optimizer), compiled = flag("compiled_loss", x.compiled_loss);
    var accum = count("grad_accum_steps", x.grad_accum_steps);
    if (GRAD_SYNCS.indexOf(x.fsdp_grad_sync) < 0) {
      throw new Error("fsdp_grad_sync must be one of " + GRAD_SYNCS.join(", ") + ", got " + repr(x.fsdp_grad_sync));
    }
    if (checkpointing && selective) {
      throw new Error("activation_checkpointing and selective_recompute exclude each other");
    }
    if (a % kvHeads) {
      throw new Error("Attention heads (" + a + ") must be a multiple of key/value heads (" + kvHeads + ")");
    }
    if (a % t || kvHeads % t) {
      throw new Error("Attention heads (" + a + ") and key/value heads (" + kvHeads + ") must be multiples " +
        "of the tensor-parallel degree (" + t + ")");
    }
    if (layers % pp) throw new Error("Layers (" + layers + ") must be a multiple of the pipeline stages (" + pp + ")");
    if (s % cp) {
      throw new Error("Sequence length (" + s + ") must be a multiple of the context-parallel degree (" + cp + ")");
    }
    var m = {
      params: p, world_size: n, strategy: x.strategy, seq_len: s, micro_batch: b, hidden: h, n_heads: a,
      n_layers: layers, activation_checkpointing: checkpointing, stores_attention_scores: scores,
      param_bytes: weights, grad_bytes: grads, master_bytes: master, optimizer_bytes: moments, ffn_hidden: f,
      gated_mlp: gated, n_kv_heads: kvHeads, vocab_size: vocab, tp_degree: t, pp_degree: pp, cp_degree: cp,
      sequence_parallel: sp, compute_bytes: c, transients: peak, selective_recompute: selective,
      offload_optimizer: offload, grad_accum_steps: accum, fsdp_grad_sync: x.fsdp_grad_sync, compiled_loss: compiled
    };
    m.tokens = s * b / cp;
    m.kv_width = h / a * kvHeads;
    m.sp_divisor = sp ? t : 1;
    m.layer_input = c * m.tokens * h / m.sp_divisor;
    m.stage_layers = layers / pp;
    m.gathered = (x.strategy === "zero3" || x.strategy === "fsdp") && n > 1;
    return m;
  }

  function memory_sharded_states(m) {
    var sharded = {
      ddp: [], zero1: ["master_bytes", "optimizer_bytes"],
      zero2: ["master_bytes", "optimizer_bytes", "grads_bytes"]
    }[m.strategy] || MODEL_STATES;
    if (m.grad_accum_steps > 1 && m.fsdp_grad_sync === "last") {  // held unsharded until the last micro-batch
      sharded = sharded.filter(function (key) { return key !== "grads_bytes"; });
    }
    return sharded;
  }

  function memory_model_state(m) {
    var sharded = memory_sharded_states(m);
    var perParam = [m.param_bytes, m.grad_bytes, m.master_bytes, m.optimizer_bytes];
    var state = {};
    MODEL_STATES.forEach(function (key, i) {
      state[key] = m.params / (m.tp_degree * m.pp_degree) * perParam[i] / (sharded.indexOf(key) >= 0 ? m.world_size : 1);
    });
    var offloaded = m.offload_optimizer ? state.master_bytes + state.optimizer_bytes : 0;
    if (m.offload_optimizer) state.master_bytes = state.optimizer_bytes = 0;
    state.model_state_bytes = state.params_bytes + state.grads_bytes + state.master_bytes + state.optimizer_bytes;
    state.offloaded_bytes = offloaded;
    return state;
  }

  function memory_attention_activations(m) {
    var c = m.compute_bytes, h = m.hidden, kv = m.kv_width;
    var scores = m.stores_attention_scores ? m.tokens * 5 * m.n_heads * m.seq_len / m.cp_degree / m.tp_degree : 0;
    if (!m.gated_mlp) return {around: c * h + h, gathered: 0, inside: c * (2 * h + 2 * kv), scores: scores};
    var regathered = m.sequence_parallel && m.tp_degree > 1;  // the q/k/v input, gathered and kept whole
    return {around: regathered ? 0 : c * h, gathered: regathered ? c * h : 0,
      inside: c * (2 * h + 2 * kv) + 4 * m.n_heads, scores: scores};
  }

  function memory_mlp_activations(m) {
    var c = m.compute_bytes, h = m.hidden, f = m.ffn_hidden;
    if (!m.gated_mlp) return {around: c * h + h, gathered: 0, inside: c * 2 * f};
    var regathered = m.sequence_parallel && m.tp_degree > 1;  // w1's and w3's inputs, each its own copy
    return {around: regathered ? 0 : c * h, gathered: regathered ? 2 * c * h : 0, inside: c * 4 * f};
  }

  function memory_norm_activations(m) {
    var c = m.compute_bytes, h = m.hidden;
    return {around: m.gated_mlp ? c * 8 * h + 8 : c * 2 * h, gathered: 0, inside: 0};
  }

  function memory_layer_activations(m) {
    var kinds = [memory_attention_activations(m), memory_mlp_activations(m), memory_norm_activations(m)];
    function sum(key) { return kinds[0][key] + kinds[1][key] + kinds[2][key]; }
    return m.tokens * (sum("around") / m.sp_divisor + sum("gathered") + sum("inside") / m.tp_degree) + kinds[0].scores;
  }

  function memory_stored_activations(m) {
    var perLayer = memory_layer_activations(m);
    var recomputedScores = m.selective_recompute ? memory_attention_activations(m).scores : 0;
    var kept = perLayer - recomputedScores;
    var stored = m.stage_layers * m.pp_degree * (m.activation_checkpointing ? m.layer_input : kept);
    return {activation_bytes_per_layer: perLayer, kept_per_layer: kept, stored_bytes: stored,
      activation_bytes: stored + (m.activation_checkpointing ? perLayer : recomputedScores)};
  }

  function memory_parameter_counts(m) {
    var h = m.hidden, kv = m.kv_width, f = m.ffn_hidden, t = m.tp_degree;
    return {block: (h * (h + 2 * kv) + h * h + (m.gated_mlp ? 3 : 2) * h * f) / t + 2 * h,
      attention: (h * (h + 2 * kv) + h * h) / t,
      root: (m.pp_degree === 1 ? 2 : 1) * m.vocab_size * h / t + (m.vocab_size ? h : 0)};
  }

  function memory_held_gradients(m) {
    return m.gathered && memory_sharded_states(m).indexOf("grads_bytes") < 0 ? memory_model_state(m).grads_bytes : null;
  }

  function memory_loss_activations(m) {
    var c = m.compute_bytes, logits = m.tokens * m.vocab_size / m.tp_degree;
    var fused = m.compiled_loss && m.tp_degree === 1;  // a compiled loss keeps the logits and their gradient at c
    return {around_root: m.vocab_size ? 4 * m.layer_input + c * m.tokens * m.hidden : 0,
      kept_logits: fused ? c * logits : 4 * logits,
      loss_temporaries: fused ? c * logits : (m.tp_degree > 1 ? 3 : 2) * 4 * logits};
  }

  function memory_loss_moments(m) {
    var c = m.compute_bytes, grads = memory_model_state(m).grads_bytes, held = memory_held_gradients(m);
    var stored = memory_stored_activations(m).stored_bytes, loss = memory_loss_activations(m);
    var atLoss = {
      sharded_grads_bytes: m.gathered && held === null ? 0 : grads,
      unsharded_params_bytes: m.gathered ? c * memory_parameter_counts(m).root : 0,
      all_gather_bytes: 0, reduce_scatter_bytes: 0,
      activation_bytes: stored + loss.around_root + loss.kept_logits,
      temporary_bytes: loss.loss_temporaries
    };
    if (!m.vocab_size) return [atLoss];
    var norm = copyOf(atLoss);  // the final norm's backward
    norm.activation_bytes = stored + 2 * m.layer_input;
    norm.temporary_bytes = c * m.vocab_size * m.hidden / m.tp_degree + 6 * 4 * m.tokens * m.hidden / m.sp_divisor;
    return [atLoss, norm];
  }

  function memory_block_moments(m) {
    if (!m.gathered) return [];
    var c = m.compute_bytes, layers = m.stage_layers, layerInput = m.layer_input;
    var counts = memory_parameter_counts(m), acts = memory_stored_activations(m), held = memory_held_gradients(m);
    var block = counts.block, recomputed = m.tokens * c * m.ffn_hidden / m.tp_degree;
    var outputGrad = c * m.vocab_size * m.hidden / m.tp_degree, reducing = m.grad_bytes * block;
    var blocks = [0, Math.min(1, layers - 1), Math.max(layers - 2, 0), layers - 1];
    blocks = blocks.filter(function (v, i) { return blocks.indexOf(v) === i; }).sort(function (p1, p2) {
      return p1 - p2;
    });
    var moments = [];
    blocks.forEach(function (at) {
      var below = m.activation_checkpointing ? (at + 1) * m.pp_degree * layerInput
        : at * m.pp_degree * acts.kept_per_layer;
      var done = (layers - 1 - at) * block * m.grad_bytes / m.world_size;
      var unsharded = c * (counts.root + block);
      var gathering = at > 0 && at < layers - 1 ? c * block : 0;
      moments.push({
        sharded_grads_bytes: held === null ? done : held, unsharded_params_bytes: unsharded,
        all_gather_bytes: at > 0 && !m.activation_checkpointing ? c * block : gathering,
        reduce_scatter_bytes: at < layers - 1 ? reducing : 0,
        activation_bytes: below + acts.activation_bytes_per_layer - recomputed,
        temporary_bytes: 4 * recomputed + (m.activation_checkpointing ? outputGrad + layerInput : 0)
      });
      moments.push({
        sharded_grads_bytes: held === null ? done : held, unsharded_params_bytes: unsharded,
        all_gather_bytes: gathering, reduce_scatter_bytes: reducing,
        activation_bytes: below + 2 * layerInput,
        temporary_bytes: c * (block + counts.attention) + outputGrad + 2 * layerInput
      });
    });
    return moments;
  }

  function memory_peak(m) {
    var state = memory_model_state(m);
    var tokenIds = m.vocab_size ? 8 * m.tokens : 0;
    var moments = memory_loss_moments(m).concat(memory_block_moments(m));
    var worst = moments[0];
    moments.forEach(function (moment) { if (total(moment) > total(worst)) worst = moment; });
    var fixed = state.params_bytes + (state.master_bytes + state.optimizer_bytes) + tokenIds;
    var out = copyOf(worst);
    out.input_bytes = tokenIds;
    out.total_bytes = fixed + total(worst);
    return out;
  }

  // ------------------------------------------------------------ the calculators

  function memory(inputs) {
    var m = memory_inputs(bind("memory", inputs,
      ["params", "world_size", "strategy", "seq_len", "micro_batch", "hidden", "n_heads", "n_layers"],
      {activation_checkpointing: false, stores_attention_scores: false, param_bytes: 2, grad_bytes: 2,
        master_bytes: 4, optimizer_bytes: 8, ffn_hidden: null, gated_mlp: false, n_kv_heads: null,
        vocab_size: 0, tp_degree: 1, pp_degree: 1, cp_degree: 1, sequence_parallel: false,
        compute_bytes: 2, transients: false, selective_recompute: false, offload_optimizer: false,
        grad_accum_steps: 1, fsdp_grad_sync: "last", compiled_loss: false}));
    var state = memory_model_state(m), activations = memory_stored_activations(m);
    var out = {};
    MODEL_STATES.forEach(function (key) { out[key] = state[key]; });
    out.model_state_bytes = state.model_state_bytes;
    out.activation_bytes_per_layer = activations.activation_bytes_per_layer;
    out.activation_bytes = activations.activation_bytes;
    out.sharded_params_bytes = state.params_bytes;
    out.sharded_grads_bytes = state.grads_bytes;
    out.optimizer_state_bytes = state.master_bytes + state.optimizer_bytes;
    ["unsharded_params_bytes", "all_gather_bytes", "reduce_scatter_bytes", "temporary_bytes", "input_bytes"].forEach(
      function (key) { out[key] = 0; });
    out.offloaded_bytes = state.offloaded_bytes;
    out.total_bytes = state.model_state_bytes + activations.activation_bytes;
    if (!m.transients) return out;
    var peak = memory_peak(m);
    Object.keys(peak).forEach(function (key) { out[key] = peak[key]; });
    return out;
  }

  function ring_allreduce(inputs) {
    var x = bind("ring_allreduce", inputs, ["size_bytes", "world_size", "bandwidth_bytes_per_s"],
      {latency_s: 0});
    var size = positive("size_bytes", x.size_bytes);
    var n = count("world_size", x.world_size, 2);
    var bandwidth = positive("bandwidth_bytes_per_s", x.bandwidth_bytes_per_s);
    var latency = nonNegative("latency_s", x.latency_s);
    var factor = 2 * (n - 1) / n;
    var steps = 2 * (n - 1);
    var time = factor * size / bandwidth + steps * latency;
    return {bytes_per_rank: factor * size, steps: steps, time_s: time,
      algorithm_bandwidth: size / time, bus_bandwidth: size / time * factor};
  }

  function fsdp_comm(inputs) {
    var x = bind("fsdp_comm", inputs, ["params", "world_size", "bandwidth_bytes_per_s"],
      {param_bytes: 2, grad_bytes: 2, reshard_after_forward: true});
    var p = positive("params", x.params);
    var n = count("world_size", x.world_size, 2);
    var bandwidth = positive("bandwidth_bytes_per_s", x.bandwidth_bytes_per_s);
    var gatherBytes = positive("param_bytes", x.param_bytes), reduceBytes = positive("grad_bytes", x.grad_bytes);
    var gathers = flag("reshard_after_forward", x.reshard_after_forward) ? 2 : 1;
    var share = (n - 1) / n;
    var allGather = gathers * share * p * gatherBytes;
    var reduceScatter = share * p * reduceBytes;
    var total = allGather + reduceScatter;
    var ddp = 2 * share * p * reduceBytes;
    return {all_gather_bytes: allGather, reduce_scatter_bytes: reduceScatter, bytes_per_rank: total,
      ddp_bytes_per_rank: ddp, ratio_to_ddp: total / ddp, time_s: total / bandwidth};
  }

  function tp_comm(inputs) {
    var x = bind("tp_comm", inputs,
      ["seq_len", "micro_batch", "hidden", "n_layers", "tp_degree", "bandwidth_bytes_per_s"],
      {activation_bytes: 2});
    var tokens = count("seq_len", x.seq_len) * count("micro_batch", x.micro_batch);
    var h = count("hidden", x.hidden), layers = count("n_layers", x.n_layers);
    var t = count("tp_degree", x.tp_degree, 2);
    var bandwidth = positive("bandwidth_bytes_per_s", x.bandwidth_bytes_per_s);
    var size = tokens * h * positive("activation_bytes", x.activation_bytes);
    var perLayer = 4 * 2 * (t - 1) / t * size;
    return {allreduce_bytes: size, allreduces_per_layer: 4, bytes_per_layer: perLayer,
      bytes_per_microbatch: layers * perLayer, time_s: layers * perLayer / bandwidth};
  }

  function pp_comm(inputs) {
    var x = bind("pp_comm", inputs,
      ["seq_len", "micro_batch", "hidden", "stages", "bandwidth_bytes_per_s"], {activation_bytes: 2});
    var tokens = count("seq_len", x.seq_len) * count("micro_batch", x.micro_batch);
    var h = count("hidden", x.hidden), p = count("stages", x.stages, 2);
    var bandwidth = positive("bandwidth_bytes_per_s", x.bandwidth_bytes_per_s);
    var size = tokens * h * positive("activation_bytes", x.activation_bytes);
    var perRank = size * (p > 2 ? 2 : 1);
    return {boundary_bytes: size, bytes_per_rank: perRank, total_bytes: 2 * (p - 1) * size,
      time_s: perRank / bandwidth};
  }

  function moe_all_to_all(inputs) {
    var x = bind("moe_all_to_all", inputs,
      ["tokens", "hidden", "top_k", "ep_degree", "bandwidth_bytes_per_s"], {activation_bytes: 2});
    var rows = count("tokens", x.tokens) * count("top_k", x.top_k);
    var h = count("hidden", x.hidden), e = count("ep_degree", x.ep_degree, 2);
    var bandwidth = positive("bandwidth_bytes_per_s", x.bandwidth_bytes_per_s);
    var buffer = rows * h * positive("activation_bytes", x.activation_bytes);
    var perCall = buffer * (e - 1) / e;
    return {buffer_bytes: buffer, all_to_alls_per_layer: 4, bytes_per_all_to_all: perCall,
      bytes_sent_per_layer: 4 * perCall, bytes_received_per_layer: 4 * perCall, time_s: 4 * perCall / bandwidth};
  }

  function pipeline_bubble(inputs) {
    var x = bind("pipeline_bubble", inputs, ["stages", "microbatches"], {interleave: 1, schedule: "1f1b"});
    var p = count("stages", x.stages), m = count("microbatches", x.microbatches);
    var v = count("interleave", x.interleave);
    if (PIPELINE_SCHEDULES.indexOf(x.schedule) < 0) {
      throw new Error("schedule must be one of " + PIPELINE_SCHEDULES.join(", ") + ", got " + repr(x.schedule));
    }
    if (x.schedule === "zbv" && v !== 2) {
      throw new Error("the zbv schedule runs 2 chunks per stage: interleave must be 2, got " + v);
    }
    if (x.schedule === "zero_bubble" && m % p) {
      throw new Error("the zero_bubble schedule needs microbatches (" + m + ") to be a multiple of stages (" + p + ")");
    }
    if (x.schedule === "1f1b" && v > 1 && m % p) {
      throw new Error("an interleaved schedule needs microbatches (" + m + ") to be a multiple of stages (" + p + ")");
    }
    // Idle and busy time per stage: for "1f1b" in slots of a chunk's forward and backward,
    // for the zero-bubble schedules in units of a forward (as calc/schedules.py).
    var idle, busy;
    if (x.schedule === "1f1b") {
      idle = p - 1; busy = v * m;
    } else if (x.schedule === "zero_bubble") {
      idle = p - 1; busy = 3 * v * m;
    } else {
      idle = Math.max(p - 1, 2 * (2 * p - 1 - m)); busy = 6 * m;
    }
    var bubble = idle / (busy + idle);
    return {bubble_fraction: bubble, bubble_over_ideal: idle / busy, efficiency: 1 - bubble};
  }

  function checkpoint_interval(inputs) {
    var x = bind("checkpoint_interval", inputs, ["checkpoint_cost_s", "mtbf_s"], {restart_s: 0});
    var c = positive("checkpoint_cost_s", x.checkpoint_cost_s), m = positive("mtbf_s", x.mtbf_s);
    var r = nonNegative("restart_s", x.restart_s);
    if (Math.max(c, r) > MAX_COST_OVER_MTBF * m) {
      throw new Error("checkpoint_cost_s and restart_s must not exceed " + MAX_COST_OVER_MTBF + " x mtbf_s");
    }
    var young = Math.sqrt(2 * c * m);
    var ratio = c / (2 * m);
    var daly = c < 2 * m ? young * (1 + Math.sqrt(ratio) / 3 + ratio / 9) - c : m;
    var dalyOverhead = m * Math.exp(r / m) * Math.expm1((daly + c) / m) / daly - 1;
    return {young_interval_s: young, young_overhead_fraction: c / young + young / (2 * m),
      daly_interval_s: daly, daly_overhead_fraction: dalyOverhead};
  }

  // e^x - 1 - x without the cancellation of expm1(x) - x near 0 (as calc/failures.py).
  function expMinusOneMinusX(x) {
    if (Math.abs(x) >= 0.5) return Math.expm1(x) - x;
    var term = x * x / 2, total = 0;
    for (var k = 3; k < 40; k++) {
      total += term;
      term *= x / k;
      if (Math.abs(term) <= 1e-17 * Math.abs(total)) break;
    }
    return total;
  }

  // The y = lambda tau minimising (e^(y + c) - 1) / y: Newton on z = -ln(1 - y) (as calc/failures.py).
  function optimalWorkOverMtbf(c) {
    var z = c <= 0.5 ? 2 * Math.sqrt(c) : c + 1;
    for (var i = 0; i < 100; i++) {
      var step = (expMinusOneMinusX(-z) - c) / -Math.expm1(-z);
      if (!(step > 1e-16 * z)) break;
      z -= step;
    }
    return -Math.expm1(-z);
  }

  function goodput(inputs) {
    var x = bind("goodput", inputs, ["n_gpus", "mtbf_gpu_hours", "save_s", "restart_s"], {interval_s: null});
    var n = count("n_gpus", x.n_gpus);
    var mtbf = positive("mtbf_gpu_hours", x.mtbf_gpu_hours) * 3600 / n;
    var c = positive("save_s", x.save_s), r = nonNegative("restart_s", x.restart_s);
    var tau = x.interval_s === null ? null : positive("interval_s", x.interval_s);
    if (Math.max(c, r, tau || 0) > MAX_COST_OVER_MTBF * mtbf) {
      throw new Error("save_s, restart_s and interval_s must not exceed " + MAX_COST_OVER_MTBF +
        " x the job's MTBF (mtbf_gpu_hours x 3600 / n_gpus)");
    }
    var rate = 1 / mtbf;
    var best = optimalWorkOverMtbf(c * rate) * mtbf;
    if (tau === null) tau = best;
    function shares(work) {
      var failures = Math.expm1(rate * (work + c));
      var cycle = (mtbf + r) * failures;
      var lost = expMinusOneMinusX(rate * (work + c)) * mtbf;
      return [work / cycle, c / cycle, lost / cycle, failures * r / cycle, failures];
    }
    var got = shares(tau);
    var young = Math.sqrt(2 * c * mtbf);
    var ratio = c / (2 * mtbf);
    return {goodput: got[0], save_fraction: got[1], lost_fraction: got[2], restart_fraction: got[3],
      interval_s: tau, optimal_interval_s: best, optimal_goodput: shares(best)[0], young_interval_s: young,
      daly_interval_s: c < 2 * mtbf ? young * (1 + Math.sqrt(ratio) / 3 + ratio / 9) - c : mtbf,
      job_mtbf_s: mtbf, failures_per_day: 86400 / mtbf, failures_per_checkpoint: got[4]};
  }

  function mfu(inputs) {
    var x = bind("mfu", inputs,
      ["flops_per_sample", "samples_per_step", "step_time_s", "n_gpus", "peak_flops_per_gpu"], {});
    var work = positive("flops_per_sample", x.flops_per_sample) * positive("samples_per_step", x.samples_per_step);
    var time = positive("step_time_s", x.step_time_s), gpus = count("n_gpus", x.n_gpus);
    var peak = positive("peak_flops_per_gpu", x.peak_flops_per_gpu);
    var achieved = work / time / gpus;
    return {samples_per_s: x.samples_per_step / time, achieved_flops_per_gpu: achieved,
      mfu: achieved / peak, ideal_step_time_s: work / (gpus * peak)};
  }

  function step_time(inputs) {
    var x = bind("step_time", inputs,
      ["flops_per_sample", "samples_per_step", "n_gpus", "peak_flops_per_gpu", "mfu"], {});
    var work = positive("flops_per_sample", x.flops_per_sample) * positive("samples_per_step", x.samples_per_step);
    var gpus = count("n_gpus", x.n_gpus), peak = positive("peak_flops_per_gpu", x.peak_flops_per_gpu);
    if (positive("mfu", x.mfu) > 1) throw new Error("mfu must be at most 1, got " + repr(x.mfu));
    var time = work / (gpus * peak * x.mfu);
    return {step_time_s: time, samples_per_s: x.samples_per_step / time, achieved_flops_per_gpu: peak * x.mfu};
  }

  window.handbookCalc = {
    memory: memory, ring_allreduce: ring_allreduce, fsdp_comm: fsdp_comm, tp_comm: tp_comm,
    pp_comm: pp_comm, moe_all_to_all: moe_all_to_all, pipeline_bubble: pipeline_bubble, checkpoint_interval: checkpoint_interval, mfu: mfu,
    step_time: step_time, goodput: goodput
  };
  // The parts calc.memory is composed of, for the test that compares them with calc/memory_model.py's.
  window.handbookCalcMemoryParts = {
    memory_inputs: memory_inputs, memory_sharded_states: memory_sharded_states,
    memory_model_state: memory_model_state, memory_attention_activations: memory_attention_activations,
    memory_mlp_activations: memory_mlp_activations, memory_norm_activations: memory_norm_activations,
    memory_layer_activations: memory_layer_activations, memory_stored_activations: memory_stored_activations,
    memory_parameter_counts: memory_parameter_counts, memory_held_gradients: memory_held_gradients,
    memory_loss_activations: memory_loss_activations, memory_loss_moments: memory_loss_moments,
    memory_block_moments: memory_block_moments, memory_peak: memory_peak
  };

  // ------------------------------------------------------------ display

  function plain(x) {
    var size = Math.abs(x);
    if (size === 0) return "0";
    if (size >= 1000) return Math.round(x).toLocaleString("en-US");
    if (size >= 100) return x.toFixed(0);
    if (size >= 10) return x.toFixed(1);
    if (size >= 1) return x.toFixed(2);
    return x.toPrecision(3);
  }

  function seconds(x) {
    if (x < 1) return plain(x * 1e3) + " ms";
    if (x < 120) return plain(x) + " s";
    if (x < 7200) return plain(x / 60) + " min";
    return plain(x / 3600) + " h";
  }

  var FORMAT = {
    bytes: function (x) { return plain(x / 1e9) + " GB"; },
    rate: function (x) { return plain(x / 1e9) + " GB/s"; },
    flops: function (x) { return plain(x / 1e12) + " TFLOP/s"; },
    seconds: seconds,
    percent: function (x) { return (100 * x).toFixed(1) + "%"; },
    ratio: function (x) { return plain(x) + "×"; },
    count: function (x) { return String(x); },
    plain: plain
  };

  // The most memory one accelerator has (AMD MI355X, NVIDIA B300: 288 GB of HBM3E): a
  // per-GPU answer above it is a configuration no machine runs, so the form says so.
  var LARGEST_ACCELERATOR_BYTES = 288e9;

  // A choice that sets several inputs at once.
  var RECOMPUTE = {
    none: {activation_checkpointing: false, selective_recompute: false},
    selective: {activation_checkpointing: false, selective_recompute: true},
    full: {activation_checkpointing: true, selective_recompute: false}
  };

  // The presets: a model on a cluster, with each calculator's inputs as reference_impl.calc
  // takes them (docs/javascripts/calculator_presets.json, which tests/test_calculator_presets.py
  // runs through the Python twins). Fetched once, beside this script; a form offers the
  // presets that name it, in its own units.
  var PRESETS_URL = document.currentScript ? new URL("calculator_presets.json", document.currentScript.src).href : null;
  var presetTable = null;
  function loadPresets() {
    if (!presetTable) {
      presetTable = (PRESETS_URL && window.fetch ? fetch(PRESETS_URL).then(function (response) {
        if (!response.ok) throw new Error("calculator presets: HTTP " + response.status);
        return response.json();
      }) : Promise.resolve({presets: []})).then(function (table) {
        window.handbookCalcPresets = table.presets;
        return table.presets;
      });
    }
    return presetTable;
  }

  // Form fields: [input key, label, kind, default shown, scale from the shown unit to the input's].
  // Kinds: "number", "optional" (a number; an empty box leaves the input out), "check", an
  // array of choices, or an object whose choices each set several inputs. A form may name a
  // headline output (kept in view beside the fields), fields folded under "More inputs"
  // (`advanced`: shown only on request), and checks that flag an implausible result instead
  // of printing it.
  var FORMS = {
    memory: {
      fields: [
        ["params", "Parameters (billions)", "number", 7, 1e9],
        ["world_size", "Data-parallel GPUs N", "number", 8],
        ["strategy", "Strategy", STRATEGIES, "fsdp"],
        ["seq_len", "Sequence length", "number", 2048],
        ["micro_batch", "Micro-batch (sequences per GPU)", "number", 1],
        ["hidden", "Hidden size", "number", 4096],
        ["n_heads", "Attention heads", "number", 32],
        ["n_layers", "Layers", "number", 32],
        ["recompute", "Activation recompute", RECOMPUTE, "none"],
        ["stores_attention_scores", "Unfused attention (stores scores)", "check", false],
        ["param_bytes", "Bytes/param: weights", "number", 2],
        ["grad_bytes", "Bytes/param: gradients", "number", 2],
        ["master_bytes", "Bytes/param: fp32 master copy", "number", 4],
        ["optimizer_bytes", "Bytes/param: optimizer state", "number", 8],
        ["ffn_hidden", "FFN hidden size", "number", 16384],
        ["gated_mlp", "Gated MLP (SwiGLU)", "check", false],
        ["n_kv_heads", "Key/value heads", "number", 32],
        ["vocab_size", "Vocabulary size", "number", 0],
        ["tp_degree", "Tensor-parallel degree", "number", 1],
        ["pp_degree", "Pipeline stages", "number", 1],
        ["cp_degree", "Context-parallel degree", "number", 1],
        ["sequence_parallel", "Sequence parallel", "check", false],
        ["compute_bytes", "Bytes per activation", "number", 2],
        ["transients", "Count transients (the step's peak)", "check", false],
        ["offload_optimizer", "Offload optimizer state to CPU", "check", false],
        ["grad_accum_steps", "Gradient accumulation steps", "number", 1],
        ["fsdp_grad_sync", "Gradient reduce-scatter (with accumulation)", GRAD_SYNCS, "last"]
      ],
      headline: "total_bytes",
      advanced: ["stores_attention_scores", "param_bytes", "grad_bytes", "master_bytes", "optimizer_bytes",
        "ffn_hidden", "gated_mlp", "n_kv_heads", "vocab_size", "tp_degree", "pp_degree", "cp_degree",
        "sequence_parallel", "compute_bytes", "transients", "offload_optimizer", "grad_accum_steps",
        "fsdp_grad_sync"],
      checks: [function (result) {
        return result.total_bytes > LARGEST_ACCELERATOR_BYTES ? {outputs: ["total_bytes"],
          message: "More than " + FORMAT.bytes(LARGEST_ACCELERATOR_BYTES) + " per GPU, the memory of the " +
            "largest accelerator: shard more, add GPUs, or recompute activations."} : null;
      }],
      outputs: [
        ["params_bytes", "Weights", "bytes"], ["grads_bytes", "Gradients", "bytes"],
        ["master_bytes", "Master copy", "bytes"], ["optimizer_bytes", "Optimizer state", "bytes"],
        ["model_state_bytes", "Model state", "bytes"],
        ["activation_bytes_per_layer", "Activations per layer (no checkpointing)", "bytes"],
        ["activation_bytes", "Activations (at the peak with transients)", "bytes"],
        ["sharded_grads_bytes", "Gradients at the peak", "bytes"],
        ["unsharded_params_bytes", "Gathered weights", "bytes"],
        ["all_gather_bytes", "All-gather buffer", "bytes"], ["reduce_scatter_bytes", "Reduce-scatter buffer", "bytes"],
        ["temporary_bytes", "Temporaries", "bytes"], ["offloaded_bytes", "Offloaded to host memory", "bytes"],
        ["total_bytes", "Total per GPU", "bytes"]
      ]
    },
    ring_allreduce: {
      headline: "time_s",
      fields: [
        ["size_bytes", "Size reduced (GB)", "number", 2, 1e9],
        ["world_size", "Ranks N", "number", 8],
        ["bandwidth_bytes_per_s", "Bandwidth per rank (GB/s)", "number", 50, 1e9],
        ["latency_s", "Latency per step (µs)", "number", 0, 1e-6]
      ],
      outputs: [
        ["bytes_per_rank", "Sent per rank", "bytes"], ["steps", "Steps", "count"],
        ["time_s", "Time", "seconds"], ["algorithm_bandwidth", "Algorithm bandwidth", "rate"],
        ["bus_bandwidth", "Bus bandwidth", "rate"]
      ]
    },
    fsdp_comm: {
      headline: "ratio_to_ddp",
      fields: [
        ["params", "Parameters (billions)", "number", 1, 1e9],
        ["world_size", "Ranks N", "number", 8],
        ["bandwidth_bytes_per_s", "Bandwidth per rank (GB/s)", "number", 50, 1e9],
        ["param_bytes", "Bytes per gathered parameter", "number", 2],
        ["grad_bytes", "Bytes per reduced gradient", "number", 2],
        ["reshard_after_forward", "Reshard after forward (gather again in backward)", "check", true]
      ],
      outputs: [
        ["all_gather_bytes", "All-gathers, sent per rank", "bytes"],
        ["reduce_scatter_bytes", "Reduce-scatter, sent per rank", "bytes"],
        ["bytes_per_rank", "FSDP total per rank", "bytes"], ["ddp_bytes_per_rank", "DDP all-reduce per rank", "bytes"],
        ["ratio_to_ddp", "FSDP / DDP", "ratio"], ["time_s", "Time (not overlapped)", "seconds"]
      ]
    },
    tp_comm: {
      headline: "time_s",
      fields: [
        ["seq_len", "Sequence length", "number", 4096],
        ["micro_batch", "Micro-batch (sequences)", "number", 1],
        ["hidden", "Hidden size", "number", 8192],
        ["n_layers", "Layers", "number", 80],
        ["tp_degree", "TP degree t", "number", 8],
        ["bandwidth_bytes_per_s", "Bandwidth per rank (GB/s)", "number", 400, 1e9],
        ["activation_bytes", "Bytes per activation", "number", 2]
      ],
      outputs: [
        ["allreduce_bytes", "One all-reduce", "bytes"], ["allreduces_per_layer", "All-reduces per layer", "count"],
        ["bytes_per_layer", "Sent per rank per layer", "bytes"],
        ["bytes_per_microbatch", "Sent per rank per micro-batch", "bytes"],
        ["time_s", "Time (not overlapped)", "seconds"]
      ]
    },
    pp_comm: {
      headline: "time_s",
      fields: [
        ["seq_len", "Sequence length", "number", 4096],
        ["micro_batch", "Micro-batch (sequences)", "number", 1],
        ["hidden", "Hidden size", "number", 8192],
        ["stages", "Stages p", "number", 8],
        ["bandwidth_bytes_per_s", "Bandwidth per rank (GB/s)", "number", 50, 1e9],
        ["activation_bytes", "Bytes per activation", "number", 2]
      ],
      outputs: [
        ["boundary_bytes", "Across one boundary, one way", "bytes"],
        ["bytes_per_rank", "Sent by a middle stage", "bytes"],
        ["total_bytes", "Whole pipeline, both ways", "bytes"],
        ["time_s", "Time (not overlapped)", "seconds"]
      ]
    },
    moe_all_to_all: {
      headline: "time_s",
      fields: [
        ["tokens", "Tokens per rank (sequence x micro-batch)", "number", 8192],
        ["hidden", "Hidden size", "number", 4096],
        ["top_k", "Experts per token k", "number", 2],
        ["ep_degree", "EP degree e", "number", 8],
        ["bandwidth_bytes_per_s", "Bandwidth per rank (GB/s)", "number", 50, 1e9],
        ["activation_bytes", "Bytes per activation", "number", 2]
      ],
      outputs: [
        ["buffer_bytes", "Rows one all-to-all takes in", "bytes"],
        ["all_to_alls_per_layer", "All-to-alls per layer", "count"],
        ["bytes_per_all_to_all", "Sent per rank per all-to-all", "bytes"],
        ["bytes_sent_per_layer", "Sent per rank per layer", "bytes"],
        ["bytes_received_per_layer", "Received per rank per layer", "bytes"],
        ["time_s", "Time (not overlapped)", "seconds"]
      ]
    },
    pipeline_bubble: {
      headline: "bubble_fraction",
      fields: [
        ["stages", "Stages p", "number", 4],
        ["microbatches", "Micro-batches m", "number", 16],
        ["interleave", "Chunks per stage v", "number", 1],
        ["schedule", "Schedule (zbv: v = 2)", PIPELINE_SCHEDULES, "1f1b"]
      ],
      outputs: [
        ["bubble_fraction", "Bubble, share of the step", "percent"],
        ["bubble_over_ideal", "Bubble over ideal compute", "percent"], ["efficiency", "Efficiency", "percent"]
      ]
    },
    checkpoint_interval: {
      headline: "daly_interval_s",
      checks: [function (result) {
        return result.young_overhead_fraction > 1 || result.daly_overhead_fraction > 1 ? {
          outputs: ["young_overhead_fraction", "daly_overhead_fraction"],
          message: "An overhead above 100%: failures come faster than the job can save and restart, " +
            "so it would hardly progress. Make the save cheaper or the failures rarer."} : null;
      }],
      fields: [
        ["checkpoint_cost_s", "Blocking save cost C (s)", "number", 30],
        ["mtbf_s", "Job MTBF M (hours)", "number", 3.093, 3600],
        ["restart_s", "Restart time R (s)", "number", 60]
      ],
      outputs: [
        ["young_interval_s", "Young interval", "seconds"], ["young_overhead_fraction", "Young overhead", "percent"],
        ["daly_interval_s", "Daly interval", "seconds"],
        ["daly_overhead_fraction", "Daly overhead (with restarts)", "percent"]
      ]
    },
    goodput: {
      headline: "goodput",
      checks: [function (result) {
        return result.goodput < 0.01 ? {
          outputs: ["goodput", "optimal_goodput"],
          message: "Under 1% goodput: failures come faster than the job can save and restart, " +
            "so it would hardly progress. Make saves and restarts cheaper or the failures rarer."} : null;
      }],
      fields: [
        ["n_gpus", "GPUs", "number", 16384],
        ["mtbf_gpu_hours", "MTBF per GPU (GPU-hours)", "number", 45567],
        ["save_s", "Blocking save C (s)", "number", 30],
        ["restart_s", "Restart R (min)", "number", 10, 60],
        ["interval_s", "Interval between saves (min; empty: optimum)", "optional", null, 60]
      ],
      outputs: [
        ["goodput", "Goodput (productive share)", "percent"], ["save_fraction", "Saving", "percent"],
        ["lost_fraction", "Lost work", "percent"], ["restart_fraction", "Restarting", "percent"],
        ["interval_s", "Interval used", "seconds"], ["optimal_interval_s", "Optimal interval", "seconds"],
        ["optimal_goodput", "Goodput at the optimum", "percent"], ["job_mtbf_s", "Job MTBF", "seconds"],
        ["failures_per_day", "Job failures per day", "plain"]
      ]
    },
    mfu: {
      headline: "mfu",
      checks: [function (result) {
        return result.mfu > 1 ? {outputs: ["mfu", "achieved_flops_per_gpu"],
          message: "An MFU above 100% is impossible: check the step time, the FLOPs per sample, " +
            "the global batch and the peak."} : null;
      }],
      fields: [
        ["flops_per_sample", "Training FLOPs per sample (TFLOP)", "number", 172.032, 1e12],
        ["samples_per_step", "Samples per step (global batch)", "number", 256],
        ["step_time_s", "Measured step time (s)", "number", 2],
        ["n_gpus", "GPUs", "number", 64],
        ["peak_flops_per_gpu", "Peak per GPU (TFLOP/s)", "number", 989, 1e12]
      ],
      outputs: [
        ["samples_per_s", "Samples/s", "plain"], ["achieved_flops_per_gpu", "Achieved per GPU", "flops"],
        ["mfu", "MFU", "percent"], ["ideal_step_time_s", "Step time at 100% MFU", "seconds"]
      ]
    },
    step_time: {
      headline: "step_time_s",
      fields: [
        ["flops_per_sample", "Training FLOPs per sample (TFLOP)", "number", 172.032, 1e12],
        ["samples_per_step", "Samples per step (global batch)", "number", 256],
        ["n_gpus", "GPUs", "number", 64],
        ["peak_flops_per_gpu", "Peak per GPU (TFLOP/s)", "number", 989, 1e12],
        ["mfu", "Assumed MFU (%)", "number", 40, 0.01]
      ],
      outputs: [
        ["step_time_s", "Step time", "seconds"], ["samples_per_s", "Samples/s", "plain"],
        ["achieved_flops_per_gpu", "Achieved per GPU", "flops"]
      ]
    }
  };

  // How a form writes output `key` of calculator `name`, for the browser test of the presets.
  window.handbookCalcFormat = function (name, key, value) {
    var out = FORMS[name].outputs.filter(function (o) { return o[0] === key; })[0];
    return FORMAT[out[2]](value);
  };
  // Each form's fields, for the browser test that checks a preset fills them in their units.
  window.handbookCalcFields = {};
  Object.keys(FORMS).forEach(function (name) { window.handbookCalcFields[name] = FORMS[name].fields; });

  var STYLE = [
    ".handbook-calc{border:1px solid var(--md-default-fg-color--lightest);border-radius:.2rem;",
    "padding:.6rem .8rem;margin:1em 0;background:var(--md-code-bg-color);color:var(--md-default-fg-color)}",
    ".handbook-calc form{display:grid;grid-template-columns:repeat(auto-fill,minmax(11rem,1fr));",
    "gap:.4rem .8rem;margin:.6rem 0}",
    ".handbook-calc [hidden]{display:none}",
    ".handbook-calc details.handbook-calc__more{grid-column:1/-1;margin:0}",
    ".handbook-calc details.handbook-calc__more>summary{font-size:.64rem;cursor:pointer}",
    ".handbook-calc .handbook-calc__more-fields{display:grid;grid-template-columns:repeat(auto-fill,minmax(11rem,1fr));",
    "gap:.4rem .8rem;margin:.4rem 0 0}",
    ".handbook-calc label{display:flex;flex-direction:column;font-size:.64rem}",
    ".handbook-calc label.handbook-calc__check{flex-direction:row;align-items:center;gap:.3rem}",
    ".handbook-calc input,.handbook-calc select{font:inherit;font-size:.7rem;padding:.15rem .3rem;",
    "color:var(--md-default-fg-color);background:var(--md-default-bg-color);",
    "border:1px solid var(--md-default-fg-color--lighter);border-radius:.1rem}",
    ".handbook-calc input:focus,.handbook-calc select:focus{outline:2px solid var(--md-typeset-a-color);outline-offset:1px}",
    ".handbook-calc [aria-invalid=true]{border-color:#c62828}",
    // The headline result and any message stay in view while the fields above them scroll:
    // on a phone a long form is taller than the screen.
    ".handbook-calc__summary{position:sticky;bottom:0;z-index:1;background:var(--md-code-bg-color);",
    "border-top:1px solid var(--md-default-fg-color--lightest);padding:.3rem 0;font-size:.7rem}",
    ".handbook-calc__summary p{margin:0}",
    // A field scrolled into view (by focus, say) stops above the summary, not under it.
    ".handbook-calc form input,.handbook-calc form select{scroll-margin-bottom:6rem}",
    ".handbook-calc table.handbook-calc__result{margin:.4rem 0 0;font-size:.7rem}",
    ".handbook-calc td{padding:.1rem 1.2rem .1rem 0}",
    ".handbook-calc output{font-weight:700;font-variant-numeric:tabular-nums}",
    ".handbook-calc__error{color:#c62828;font-weight:700}",
    ".handbook-calc__warning{color:#8a4b00;font-weight:700}",
    "[data-md-color-scheme=slate] .handbook-calc__error{color:#ff8a80}",
    "[data-md-color-scheme=slate] .handbook-calc__warning{color:#ffcc80}",
    // The theme's link colour on the form's darker background is 4.1:1 in the dark palette.
    "[data-md-color-scheme=slate] .handbook-calc a{color:#8fb0ff}"
  ].join("");

  function addStyle() {
    if (document.getElementById("handbook-calc-style")) return;
    var style = document.createElement("style");
    style.id = "handbook-calc-style";
    style.textContent = STYLE;
    document.head.appendChild(style);
  }

  function element(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (key) { node.setAttribute(key, attrs[key]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function isChoice(kind) { return Array.isArray(kind) || (typeof kind === "object" && kind !== null); }

  // The fields of a form that set each calculator input (a choice field sets several).
  function fieldsByInput(spec) {
    var byInput = {};
    spec.fields.forEach(function (field) {
      var kind = field[2];
      if (isChoice(kind) && !Array.isArray(kind)) {
        Object.keys(kind[Object.keys(kind)[0]]).forEach(function (key) { byInput[key] = field; });
      } else {
        byInput[field[0]] = field;
      }
    });
    return byInput;
  }

  // A calculator's message in the form's words: the input's label for its name, its shown
  // unit for any number (a field in billions gets "at most 100", not "1e11"), no "got ...".
  // Returns the text and the field to mark.
  function describe(message, spec) {
    var byInput = fieldsByInput(spec);
    var text = message.split(", got ")[0]
      .replace(/must be a finite number/, "must be a number")
      .replace(/>= /g, "≥ ");
    var lead = /^(\w+) (must|is) /.exec(text);
    var field = lead && byInput[lead[1]];
    if (field) {
      var rest = text.slice(lead[1].length);
      if (field[4]) {
        rest = rest.replace(/-?\d+(\.\d+)?(e[+-]?\d+)?/g, function (n) { return plain(Number(n) / field[4]); });
      }
      return {text: field[1] + rest, field: field};
    }
    Object.keys(byInput).forEach(function (key) {
      text = text.replace(new RegExp("\\b" + key + "\\b", "g"), byInput[key][1]);
    });
    return {text: text, field: null};
  }

  function render(host) {
    var name = host.getAttribute("data-calc");
    var spec = FORMS[name];
    if (!spec || host.querySelector("form")) return;
    var form = element("form", {"aria-label": name + " calculator"});
    form.addEventListener("submit", function (event) { event.preventDefault(); });
    var presetControl = null;
    var presets = {};
    (window.handbookCalcPresets || []).forEach(function (preset) {
      if (preset.inputs[name]) presets[preset.name] = preset.inputs[name];
    });
    if (Object.keys(presets).length) {
      var presetLabel = element("label");
      presetLabel.appendChild(document.createTextNode("Preset"));
      presetControl = element("select", {name: "preset"});
      presetControl.appendChild(element("option", {value: ""}, "Custom"));
      Object.keys(presets).forEach(function (choice) {
        presetControl.appendChild(element("option", {value: choice}, choice));
      });
      presetLabel.appendChild(presetControl);
      form.appendChild(presetLabel);
    }
    var more = null, moreFields = null;
    if (spec.advanced) {
      more = element("details", {"class": "handbook-calc__more"});
      more.appendChild(element("summary", {}, "More inputs (" + spec.advanced.length + ")"));
      moreFields = element("div", {"class": "handbook-calc__more-fields"});
      more.appendChild(moreFields);
    }
    spec.fields.forEach(function (field) {
      var key = field[0], kind = field[2], shown = field[3];
      var label = element("label", kind === "check" ? {"class": "handbook-calc__check"} : {});
      var input;
      if (isChoice(kind)) {
        input = element("select", {name: key});
        (Array.isArray(kind) ? kind : Object.keys(kind)).forEach(function (choice) {
          input.appendChild(element("option", {value: choice}, choice));
        });
        input.value = shown;
      } else if (kind === "check") {
        input = element("input", {name: key, type: "checkbox"});
        input.checked = shown;
      } else {
        input = element("input", {name: key, type: "number", step: "any", value: shown === null ? "" : String(shown)});
        if (kind === "optional") input.setAttribute("placeholder", "optimum");
      }
      if (kind === "check") { label.appendChild(input); label.appendChild(document.createTextNode(field[1])); }
      else { label.appendChild(document.createTextNode(field[1])); label.appendChild(input); }
      (spec.advanced && spec.advanced.indexOf(key) >= 0 ? moreFields : form).appendChild(label);
    });
    if (more) form.appendChild(more);
    var outputLabels = {};
    spec.outputs.forEach(function (out) { outputLabels[out[0]] = out; });
    var summary = element("div", {"class": "handbook-calc__summary"});
    var headline = element("p", {"class": "handbook-calc__headline"});
    var warning = element("p", {"class": "handbook-calc__warning", role: "status", hidden: ""});
    var error = element("p", {"class": "handbook-calc__error", role: "alert", hidden: ""});
    if (spec.headline) {
      headline.appendChild(document.createTextNode(outputLabels[spec.headline][1] + ": "));
      headline.appendChild(element("output", {"data-headline": spec.headline}));
      summary.appendChild(headline);
    }
    summary.appendChild(warning);
    summary.appendChild(error);
    var table = element("table", {"class": "handbook-calc__result"});
    var body = element("tbody");
    spec.outputs.forEach(function (out) {
      var row = element("tr");
      row.appendChild(element("td", {}, out[1]));
      var cell = element("td");
      cell.appendChild(element("output", {"data-output": out[0]}));
      row.appendChild(cell);
      body.appendChild(row);
    });
    table.appendChild(body);
    host.appendChild(form);
    host.appendChild(summary);
    host.appendChild(table);

    function show(key, text) {
      Array.prototype.forEach.call(host.querySelectorAll('output[data-output="' + key + '"], output[data-headline="' +
        key + '"]'), function (node) { node.textContent = text; });
    }

    function update() {
      var inputs = {};
      spec.fields.forEach(function (field) {
        var control = form.elements[field[0]], kind = field[2];
        control.removeAttribute("aria-invalid");
        if (kind === "check") inputs[field[0]] = control.checked;
        else if (Array.isArray(kind)) inputs[field[0]] = control.value;
        else if (isChoice(kind)) {
          Object.keys(kind[control.value]).forEach(function (key) { inputs[key] = kind[control.value][key]; });
        }
        // An optional field left empty is left out: the calculator's default applies.
        else if (kind === "optional" && control.value === "") return;
        // An empty box is NaN, which the calculator rejects with the input's name.
        else inputs[field[0]] = (control.value === "" ? NaN : Number(control.value)) * (field[4] || 1);
      });
      try {
        var result = window.handbookCalc[name](inputs);
        var flagged = {}, warnings = [];
        (spec.checks || []).forEach(function (check) {
          var found = check(result, inputs);
          if (!found) return;
          warnings.push(found.message);
          found.outputs.forEach(function (key) { flagged[key] = true; });
        });
        spec.outputs.forEach(function (out) {
          show(out[0], flagged[out[0]] ? "implausible" : FORMAT[out[2]](result[out[0]]));
        });
        warning.textContent = warnings.join(" ");
        warning.hidden = !warnings.length;
        table.hidden = false;
        headline.hidden = false;
        error.hidden = true;
      } catch (err) {
        var said = describe(String(err && err.message), spec);
        if (said.field) form.elements[said.field[0]].setAttribute("aria-invalid", "true");
        error.textContent = said.text;
        error.hidden = false;
        warning.hidden = true;
        headline.hidden = true;
        table.hidden = true;
      }
    }

    // A preset gives every input of its calculator in the calculator's units: each field shows
    // it in the field's unit; a choice that sets several inputs is the one that matches them.
    function fill(event) {
      var values = presets[presetControl.value];
      if (!values) return;
      spec.fields.forEach(function (field) {
        var key = field[0], kind = field[2], control = form.elements[key];
        if (isChoice(kind) && !Array.isArray(kind)) {
          var match = Object.keys(kind).filter(function (choice) {
            return Object.keys(kind[choice]).every(function (input) {
              return (values[input] === undefined ? false : values[input]) === kind[choice][input];
            });
          })[0];
          if (match !== undefined) control.value = match;
        } else if (!(key in values)) {
          return;
        } else if (kind === "check") {
          control.checked = values[key];
        } else if (Array.isArray(kind)) {
          control.value = values[key];
        } else if (values[key] === null) {  // an optional input the preset leaves out
          control.value = "";
        } else {
          control.value = String(Number((values[key] / (field[4] || 1)).toPrecision(12)));
        }
      });
      event.stopPropagation();
      update();
    }

    form.addEventListener("input", function (event) {
      // A preset describes a model; an edit of a field it set makes the form a custom one.
      if (presetControl && event.target !== presetControl) presetControl.value = "";
      update();
    });
    form.addEventListener("change", function (event) {
      if (presetControl && event.target === presetControl) fill(event);
      else update();
    });
    update();
  }

  function renderAll() {
    addStyle();
    var hosts = document.querySelectorAll(".handbook-calc[data-calc]");
    if (!hosts.length) return;
    // The forms wait for the preset table (a few kilobytes, fetched once); without it they
    // still work, with no presets.
    loadPresets().catch(function () { return []; }).then(function (presets) {
      Array.prototype.forEach.call(document.querySelectorAll(".handbook-calc-presets"), function (host) {
        listPresets(host, presets);
      });
      Array.prototype.forEach.call(hosts, render);
    });
  }

  // The calculators page lists what each preset assumes, from the same table.
  function listPresets(host, presets) {
    if (host.querySelector("dl") || !presets.length) return;
    var list = element("dl");
    presets.forEach(function (preset) {
      list.appendChild(element("dt", {}, preset.name));
      list.appendChild(element("dd", {}, preset.about));
    });
    host.appendChild(list);
  }

  // With navigation.instant, Material swaps page content without reloading scripts and
  // announces each new page on its document$ observable; without it, DOMContentLoaded.
  if (window.document$ && typeof window.document$.subscribe === "function") {
    window.document$.subscribe(renderAll);
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", renderAll);
  } else {
    renderAll();
  }
})();
