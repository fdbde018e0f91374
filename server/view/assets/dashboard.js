// twinstep dashboard: the session list, and one session's runs, heatmap, curves and first divergence.
// Live pages poll the server's JSON view (/api/sessions/NAME/view, view model: docs/dashboard.md);
// a kept report (twinstep report --html) carries the same view inline and never touches the network.
(function () {
  "use strict";

  var body = document.body;
  var PAGE = body.dataset.page;
  var MODE = body.dataset.mode;
  var SESSION = body.dataset.session;
  var POLL_MS = 1000;
  var TOKEN_KEY = "twinstep-token";
  var ROW_H = 14;
  var LABEL_W = 280;
  var PHASE_ORDER = ["forward", "loss", "backward", "grad", "param"];

  var state = {
    info: null,
    view: null,
    etag: null,
    collapsed: {},      // "run|phase|path" -> true/false, as the user left it
    candidate: null,    // heatmap candidate shown
    charts: [],
    lastOk: 0,
    timer: null,
  };

  // -- small helpers ---------------------------------------------------------------------------

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    if (attrs) {
      Object.keys(attrs).forEach(function (key) {
        var value = attrs[key];
        if (value === null || value === undefined || value === false) return;
        if (key === "text") node.textContent = value;
        else if (key === "className") node.className = value;
        else if (key.slice(0, 2) === "on") node.addEventListener(key.slice(2), value);
        else node.setAttribute(key, value === true ? "" : value);
      });
    }
    (children || []).forEach(function (child) {
      if (child === null || child === undefined) return;
      node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
    });
    return node;
  }

  function fmt(value, digits) {
    if (value === null || value === undefined) return "–";
    if (typeof value === "string") return value; // "inf", "nan"
    if (value === 0) return "0";
    var abs = Math.abs(value);
    if (abs >= 1e4 || abs < 1e-3) return value.toExponential(digits || 2);
    return value.toPrecision(digits || 3);
  }

  function token() {
    try { return sessionStorage.getItem(TOKEN_KEY) || ""; } catch (e) { return ""; }
  }

  function setToken(value) {
    try {
      if (value) sessionStorage.setItem(TOKEN_KEY, value); else sessionStorage.removeItem(TOKEN_KEY);
    } catch (e) { /* storage refused: the token lives as long as this page */ }
  }

  function headers(extra) {
    var out = extra || {};
    var t = token();
    if (t) out.Authorization = "Bearer " + t;
    return out;
  }

  function api(path, options) {
    options = options || {};
    options.headers = headers(options.headers);
    options.credentials = "omit";
    options.cache = "no-store";
    return fetch(path, options);
  }

  function errorText(response) {
    return response.json().then(function (data) { return data.error || response.statusText; },
                                function () { return response.status + " " + response.statusText; });
  }

  function decode(b64) {
    var raw = atob(b64);
    var out = new Uint8Array(raw.length);
    for (var i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }

  function sessionPath(name) { return "/api/sessions/" + encodeURIComponent(name); }

  // -- token panel -----------------------------------------------------------------------------

  function askToken(message) {
    var panel = document.getElementById("token-panel");
    panel.hidden = false;
    document.getElementById("token-message").textContent = message || "";
    document.getElementById("token-input").focus();
  }

  function showTokenStatus() {
    var status = document.getElementById("token-status");
    status.textContent = "";
    if (MODE !== "live" || !state.info || !state.info.auth_required) return;
    if (token()) {
      status.appendChild(el("span", {className: "muted", text: "token set · "}));
      status.appendChild(el("a", {href: "#", text: "forget it", onclick: function (ev) {
        ev.preventDefault(); setToken(""); askToken("Token forgotten."); showTokenStatus();
      }}));
    }
  }

  document.getElementById("token-form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    var input = document.getElementById("token-input");
    setToken(input.value.trim());
    input.value = "";
    document.getElementById("token-panel").hidden = true;
    showTokenStatus();
    state.etag = null;
    refresh();
  });

  // -- the session list ------------------------------------------------------------------------

  function renderSessions(data) {
    var app = document.getElementById("app");
    app.textContent = "";
    document.getElementById("subtitle").textContent = "sessions";
    if (!data.sessions.length) {
      app.appendChild(el("p", {className: "muted", text: "No session yet: start two trainings with twinstep.attach(...) against this server."}));
      return;
    }
    var rows = data.sessions.map(function (s) {
      return el("tr", {}, [
        el("td", {}, [el("a", {href: "/sessions/" + encodeURIComponent(s.name), className: "session-link", text: s.name})]),
        el("td", {}, [el("span", {className: "badge " + s.status, text: s.status})]),
        el("td", {text: s.runs.join(", ")}),
        el("td", {className: "num", text: String(s.steps_compared)}),
        el("td", {text: s.in_memory ? "live" : "kept report"}),
        el("td", {text: s.first_divergence || ""}),
      ]);
    });
    app.appendChild(el("table", {className: "grid", id: "sessions"}, [
      el("thead", {}, [el("tr", {}, ["session", "status", "runs", "steps compared", "held as", "first divergence"].map(function (h) { return el("th", {text: h}); }))]),
      el("tbody", {}, rows),
    ]));
  }

  // -- one session -----------------------------------------------------------------------------

  function renderView(view) {
    var app = document.getElementById("app");
    var report = view.report;
    document.title = "twinstep · " + view.session;
    var subtitle = document.getElementById("subtitle");
    subtitle.textContent = "";
    subtitle.appendChild(el("span", {id: "session-name", text: view.session}));
    subtitle.appendChild(el("span", {id: "status", className: "badge " + report.status, text: view.status_label}));
    subtitle.appendChild(el("span", {className: "muted", text: report.steps_compared + " step(s) compared"}));
    var when = new Date(view.generated_unix * 1000);
    document.getElementById("freshness").textContent = view.live ? "live · " + when.toLocaleTimeString() : "kept report · " + when.toLocaleString();

    if (!document.getElementById("runs-slot")) {
      app.textContent = "";
      ["runs-slot", "halt-slot", "reasons-slot", "preflight-slot", "divergence-slot", "heatmap-slot", "curves-slot", "long-run-slot", "errors-slot"].forEach(function (id) {
        app.appendChild(el("div", {id: id, className: id === "runs-slot" || id === "halt-slot" ? "slot half" : "slot"}));
      });
      if (view.live) document.getElementById("halt-slot").appendChild(haltPanel());
      else app.classList.add("frozen");
    }
    fill("runs-slot", runsPanel(view));
    if (view.live) updateHalt(view);
    fill("reasons-slot", report.status_reasons && report.status_reasons.length ? el("section", {className: "panel", id: "reasons"}, [
      el("h2", {text: report.status === "incomplete" ? "Not compared" : report.status === "waiting" ? "Waiting" : "Coverage"}),
      el("ul", {}, report.status_reasons.map(function (r) { return el("li", {text: r}); })),
    ]) : null);
    fill("preflight-slot", preflightPanel(view));
    fill("divergence-slot", divergencePanel(view));
    fill("heatmap-slot", heatmapPanel(view));
    updateCurves(view);
    fill("long-run-slot", longRunPanel(view));
    fill("errors-slot", report.errors && report.errors.length ? el("section", {className: "panel", id: "errors"}, [
      el("h2", {text: "Errors"}), el("ul", {}, report.errors.map(function (e) { return el("li", {text: e}); })),
    ]) : null);
  }

  function fill(id, content) {
    var slot = document.getElementById(id);
    slot.textContent = "";
    if (content) slot.appendChild(content);
  }

  function runsPanel(view) {
    var rows = view.progress.map(function (p) {
      var dropped = p.dropped ? p.dropped + " (" + Object.keys(p.dropped_by_reason).map(function (k) { return k + " " + p.dropped_by_reason[k]; }).join(", ") + ")" : "0";
      return el("tr", {"data-run": p.run}, [
        el("td", {}, [el("strong", {text: p.run})]),
        el("td", {text: p.role}),
        el("td", {text: p.framework}),
        el("td", {}, [el("span", {className: "badge " + p.state, text: p.state})]),
        el("td", {className: "num", text: p.layout || String(p.ranks)}),
        el("td", {className: "num step", text: p.last_step < 0 ? "no step yet" : String(p.last_step)}),
        el("td", {className: "num", text: p.steps_per_second === null ? "–" : fmt(p.steps_per_second, 3)}),
        el("td", {className: "num behind", text: p.steps_behind === null ? "–" : String(p.steps_behind)}),
        el("td", {className: "num", text: dropped}),
        el("td", {className: p.capture_ok ? "ok" : "bad", text: p.capture_summary}),
      ]);
    });
    var layouts = view.report.layouts || {};
    var notes = [];
    if (layouts.mode === "logical" || (layouts.differences || []).length) {
      notes.push(el("p", {className: "message", id: "layout-summary", text: "Lined up: " + layouts.summary}));
    }
    (layouts.replica_mismatches || []).slice(0, 5).forEach(function (m) {
      notes.push(el("p", {className: "message bad replica", text: m.text}));
    });
    if ((layouts.differences || []).length) {
      notes.push(el("p", {className: "message", text: layouts.differences.length + " record(s) not compared because the layouts differ (layout differences, not divergences): " +
        layouts.differences.slice(0, 5).map(function (d) { return d.phase + " of " + d.name; }).join(", ") + (layouts.differences.length > 5 ? ", ..." : "")}));
    }
    return el("section", {className: "panel grow", id: "runs"}, [
      el("h2", {text: "Runs"}),
      el("table", {className: "grid"}, [
        el("thead", {}, [el("tr", {}, ["run", "role", "framework", "state", "ranks / layout", "step", "steps/s", "steps behind", "dropped", "capture"].map(function (h) { return el("th", {text: h}); }))]),
        el("tbody", {}, rows),
      ]),
    ].concat(notes));
  }

  function haltPanel() {
    var message = el("p", {id: "halt-message", className: "message"});
    var button = el("button", {id: "halt-button", className: "danger", type: "button", text: "Halt every run"});
    var reason = el("input", {id: "halt-reason", type: "text", placeholder: "reason (optional)"});
    button.addEventListener("click", function () {
      var view = state.view;
      if (!token()) { askToken("Halting needs the operator token."); message.textContent = "Halting needs the operator token."; return; }
      button.disabled = true;
      state.halting = true;
      message.textContent = "Halting…";
      api(sessionPath(view.session) + "/halt", {
        method: "POST",
        headers: {"Content-Type": "application/json"},
        body: JSON.stringify({reason: reason.value || "halted from the dashboard"}),
      }).then(function (response) {
        if (response.ok) return response.json().then(function (data) {
          state.haltMessage = data.runs.length ? "Halt sent to: " + data.runs.join(", ") + "." : "The halt reached no run: none was connected.";
          message.textContent = state.haltMessage;
          state.etag = null;
        });
        return errorText(response).then(function (text) {
          state.haltMessage = "Refused (" + response.status + "): " + text;
          message.textContent = state.haltMessage;
          if (response.status === 401) askToken(text);
        });
      }).catch(function (err) {
        state.haltMessage = "Halt failed: " + err;
        message.textContent = state.haltMessage;
      }).then(function () { state.halting = false; if (state.view) updateHalt(state.view); });
    });
    return el("section", {className: "panel", id: "halt"}, [
      el("h2", {text: "Halt"}),
      el("p", {className: "muted", text: "Stops every process of every run of this session at one step (needs the operator token)."}),
      reason, button, message]);
  }

  function updateHalt(view) {
    var button = document.getElementById("halt-button");
    var reason = document.getElementById("halt-reason");
    var message = document.getElementById("halt-message");
    var enabled = view.halt.enabled && !view.report.halted && !state.halting;
    button.disabled = !enabled;
    reason.disabled = !view.halt.enabled;
    if (!view.halt.enabled) message.textContent = view.halt.message;
    else if (view.halt.outcome && !state.halting) message.textContent = view.halt.outcome;  // what the halt did, once known
    else if (state.haltMessage) message.textContent = state.haltMessage;
  }

  // The training set-ups' differences, diffed at attach before step 0 (report.preflight): warnings (they can
  // change the numbers) before context, each with both values and what it affects; the candidate's name
  // when the session has several.  None: no panel.
  function preflightPanel(view) {
    var findings = view.report.preflight || [];
    if (!findings.length) return null;
    var warnings = findings.filter(function (f) { return f.severity === "warning"; });
    var context = findings.filter(function (f) { return f.severity !== "warning"; });
    var several = (view.candidates || []).length > 1;
    var rows = warnings.concat(context).map(function (f) {
      var affects = f.affects.slice(0, 4).join(", ");
      var more = Math.max(f.affects.length - 4, 0) + f.affects_unlisted;
      if (more > 0) affects += " and " + more + " more";
      return el("tr", {"data-key": f.key, "data-severity": f.severity, "data-run": f.candidate_run, title: f.message}, [
        el("td", {className: f.severity === "warning" ? "bad" : "muted", text: f.severity}),
        several ? el("td", {text: f.candidate_run}) : null,
        el("td", {}, [el("code", {text: f.key})]),
        el("td", {className: "value", text: f.baseline}),
        el("td", {className: "value", text: f.candidate}),
        el("td", {className: "affects", text: affects || "–"}),
      ]);
    });
    var heads = ["", several ? "candidate" : null, "set-up", "baseline", "candidate", "affects"].filter(function (h) { return h !== null; });
    return el("section", {className: "panel", id: "preflight"}, [
      el("h2", {text: "Set-up differences (preflight)"}),
      el("p", {className: "muted", text: warnings.length + " can change the numbers" + (context.length ? ", " + context.length + " for context" : "") + "; found when the runs attached, before step 0."}),
      el("table", {className: "grid"}, [
        el("thead", {}, [el("tr", {}, heads.map(function (h) { return el("th", {text: h}); }))]),
        el("tbody", {}, rows),
      ]),
    ]);
  }

  // One candidate: the session's first divergence. Several (three-way sessions): one part per candidate,
  // each with its own verdict and first divergence against the baseline.
  function divergencePanel(view) {
    var candidates = view.candidates || [];
    if (candidates.length < 2) {
      var single = el("section", {className: "panel", id: "divergence"}, [el("h2", {text: "First divergence"})]);
      fillDivergence(single, view.divergence, view.report.status, "");
      return single;
    }
    var panel = el("section", {className: "panel", id: "divergence"}, [el("h2", {text: "First divergence, per candidate"})]);
    candidates.forEach(function (c) {
      var part = el("div", {className: "candidate-divergence", "data-run": c.run, "data-status": c.status}, [
        el("h3", {text: "candidate " + c.run + " (" + c.framework + "): " + c.status.toUpperCase() +
                        (c.halted ? ", halted" : "") + ", " + c.steps_compared + " step(s) compared"})]);
      fillDivergence(part, c.divergence, c.status, c.run);
      panel.appendChild(part);
    });
    return panel;
  }

  function fillDivergence(panel, d, status, run) {
    var ids = run === "";  // element ids only on the single panel (several candidates would repeat them)
    if (!d) {
      panel.appendChild(el("p", {className: "muted", text: status === "aligned" ? "None: every compared step is within tolerance." : "None so far."}));
      return;
    }
    var f = d.first;
    panel.appendChild(el("p", {className: "headline"}, [
      "step ", el("strong", {className: "step", text: String(f.step)}), ", rank " + f.rank + ", ",
      el("strong", {className: "phase", text: f.phase}), " of ",
      el("code", {className: "module", text: f.module || "(model)"}),
      f.candidate_module && f.candidate_module !== f.module ? " (candidate " + f.candidate_module + ")" : "",
      " in run ", el("strong", {text: f.candidate_run}), ": ",
      f.metric + " " + fmt(f.value) + " > tolerance " + fmt(f.tolerance),
    ]));
    if (f.after_gap) panel.appendChild(el("p", {className: "bad", text: "After a gap: it may have begun where nothing was compared (" + (f.gaps_summary || "") + ")."}));
    if (d.stage) panel.appendChild(el("p", {}, [el("span", {className: "label", text: "stage "}), el("span", ids ? {id: "stage", text: d.stage} : {className: "stage", text: d.stage})]));
    if (d.culprit) panel.appendChild(el("p", {}, [el("span", {className: "label", text: "culprit "}), el("span", ids ? {id: "culprit", text: d.culprit} : {className: "culprit", text: d.culprit})]));
    if (d.tree.length) {
      var withNoise = d.tree.some(function (r) { return r.noise !== null; });
      var head = ["module", "type", "metric", "value", "tolerance"].concat(withNoise ? ["noise"] : []).concat(["growth", ""]);
      var table = el("table", {className: "grid tree"}, [
        el("thead", {}, [el("tr", {}, head.map(function (h) { return el("th", {text: h}); }))]),
        el("tbody", {}, d.tree.map(function (r) {
          var cells = [
            el("td", {style: "padding-left:" + (6 + 14 * r.depth) + "px", text: r.name ? r.name.split(".").slice(-1)[0] : "(model)", title: r.name || "(model)"}),
            el("td", {text: r.type}), el("td", {text: r.metric}),
            el("td", {className: "num", text: fmt(r.value)}), el("td", {className: "num", text: fmt(r.tolerance)}),
          ];
          if (withNoise) cells.push(el("td", {className: "num", text: fmt(r.noise)}));
          cells.push(el("td", {className: "num", text: r.growth === null ? "–" : "×" + fmt(r.growth)}));
          cells.push(el("td", {className: r.divergent ? "bad" : "ok", text: r.first ? "DIVERGED ◀ first" : r.divergent ? "DIVERGED" : "ok"}));
          return el("tr", {className: r.first ? "first" : r.divergent ? "divergent" : "", "data-module": r.name}, cells);
        })),
      ]);
      var treeKey = "treeOpen" + run;
      var details = el("details", {id: ids ? "tree" : undefined, open: state[treeKey] === false ? undefined : true}, [
        el("summary", {text: "the " + f.phase + " phase at step " + f.step + " around it: " + d.tree.length + " module(s), with their growth (output error over input error)"}),
        table]);
      details.addEventListener("toggle", function () { state[treeKey] = details.open; });
      panel.appendChild(details);
    }
  }

  // -- long run and headroom ---------------------------------------------------------------------

  // A candidate's first divergence in the report's JSON (null: none), its own section's when it has one.
  function divergenceOf(report, run) {
    var own = (report.candidates || []).filter(function (c) { return c.candidate_run === run; })[0];
    if (own) return own.first_divergence;
    var first = report.first_divergence;
    return first && first.candidate_run === run ? first : null;
  }

  // The long-run criteria per candidate (the live view leaves them out: their cost grows with the steps) and,
  // per candidate and phase, the metric that came closest to its tolerance: as `twinstep report` prints them.
  function longRunPanel(view) {
    var report = view.report;
    var summaries = report.long_run || [];
    var headroom = report.headroom || [];
    if (!summaries.length && !headroom.length) return null;
    var several = (view.candidates || []).length > 1;
    var panel = el("section", {className: "panel", id: "long-run"}, [el("h2", {text: "Long run and headroom"})]);
    summaries.forEach(function (s) {
      var part = el("div", {className: "long-run-criteria", "data-run": s.candidate_run}, [
        el("h3", {text: "candidate " + s.candidate_run + ": " + s.steps + " steps compared, criteria over the last " + s.window})]);
      if (s.coverage) part.appendChild(el("p", {className: "muted", text: s.coverage}));
      part.appendChild(el("ul", {}, s.verdicts.map(function (v) {
        return el("li", {className: v.indexOf("PASS ") === 0 ? "ok" : v.indexOf("FAIL ") === 0 ? "bad" : null, text: v});
      })));
      var d = divergenceOf(report, s.candidate_run);
      if (d) part.appendChild(el("p", {className: "scope", text: "these criteria judge only the loss and the global gradient norm: the divergence above (step " + d.step + ", " + d.phase + " of '" + (d.module || "(model)") + "') stands"}));
      panel.appendChild(part);
    });
    if (headroom.length) {
      var closest = {};
      headroom.forEach(function (h) {
        var ratio = typeof h.tolerance === "number" && h.tolerance > 0 && typeof h.value === "number" ? h.value / h.tolerance : Infinity;
        var key = h.candidate_run + "|" + h.phase;
        if (!(key in closest) || ratio > closest[key].ratio) closest[key] = {ratio: ratio, h: h};
      });
      var runs = [];
      headroom.forEach(function (h) { if (runs.indexOf(h.candidate_run) < 0) runs.push(h.candidate_run); });
      var rows = [];
      runs.forEach(function (run) {
        PHASE_ORDER.forEach(function (phase) {
          var c = closest[run + "|" + phase];
          if (!c) return;
          rows.push(el("tr", {"data-run": run, "data-phase": phase}, [
            several ? el("td", {text: run}) : null,
            el("td", {text: phase}), el("td", {text: c.h.metric}),
            el("td", {className: "num", text: fmt(c.h.value)}), el("td", {className: "num", text: fmt(c.h.tolerance)}),
            el("td", {className: "num", text: isFinite(c.ratio) ? c.ratio.toFixed(3) : "no tolerance"}),
            el("td", {}, [el("code", {text: c.h.module || "(model)"})]),
            el("td", {className: "num", text: String(c.h.step)}), el("td", {text: c.h.dtype}),
          ]));
        });
      });
      var heads = [several ? "candidate" : null, "phase", "metric", "worst value", "tolerance", "share of it", "module", "step", "dtype"].filter(function (h) { return h !== null; });
      panel.appendChild(el("h3", {text: "Headroom: the worst value against its tolerance per phase, over every step compared"}));
      panel.appendChild(el("table", {className: "grid headroom"}, [
        el("thead", {}, [el("tr", {}, heads.map(function (h) { return el("th", {text: h}); }))]),
        el("tbody", {}, rows),
      ]));
    }
    return panel;
  }

  // -- the heatmap -----------------------------------------------------------------------------

  // Colour stops over t = (code - 1) / 254, i.e. log10(error / tolerance) from -3 (t = 0) to +3 (t = 1):
  // greens within tolerance (pale when far from it), yellow at it, orange to dark red beyond.
  var STOPS_WITHIN = [[0, [232, 245, 233]], [0.33, [165, 214, 167]], [0.42, [102, 187, 106]], [0.5, [253, 216, 53]]];
  var STOPS_OVER = [[0.5, [255, 152, 0]], [0.67, [229, 57, 53]], [1, [110, 0, 0]]];

  function interpolate(stops, t) {
    for (var i = 1; i < stops.length; i++) {
      if (t <= stops[i][0] || i === stops.length - 1) {
        var a = stops[i - 1], b = stops[i];
        var u = Math.max(0, Math.min(1, (t - a[0]) / (b[0] - a[0])));
        return "rgb(" + [0, 1, 2].map(function (k) { return Math.round(a[1][k] + u * (b[1][k] - a[1][k])); }).join(",") + ")";
      }
    }
    return "rgb(0,0,0)";
  }

  function colour(code) {
    if (code === 0) return "#eceff1";
    var t = (code - 1) / 254;
    return code < overFrom() ? interpolate(STOPS_WITHIN, t) : interpolate(STOPS_OVER, t);
  }

  function overFrom() { return state.view ? state.view.heatmap.scale.over_from : 129; }

  function ratioOf(code, scale) {
    if (code === 0) return null;
    var log10 = scale.log10_min + (code - 1) / 254 * (scale.log10_max - scale.log10_min);
    return Math.pow(10, log10);
  }

  function heatmapPanel(view) {
    var panel = el("section", {className: "panel", id: "heatmap"}, [
      el("h2", {text: "Error over tolerance, per module and step"}),
    ]);
    var candidates = view.heatmap.candidates;
    if (!candidates.length) {
      panel.appendChild(el("p", {className: "muted", text: view.history_kept ? "Nothing compared yet." :
        "The session has left the server's memory: only its report is kept, without the per-step history."}));
      return panel;
    }
    if (!candidates.some(function (c) { return c.run === state.candidate; })) state.candidate = candidates[0].run;
    if (candidates.length > 1) {
      panel.appendChild(el("div", {className: "tabs"}, candidates.map(function (c) {
        return el("button", {type: "button", className: c.run === state.candidate ? "tab active" : "tab", text: c.run,
                             onclick: function () { state.candidate = c.run; renderView(state.view); }});
      })));
    }
    var candidate = candidates.filter(function (c) { return c.run === state.candidate; })[0];
    if (view.history_failure) panel.appendChild(el("p", {className: "bad", text: "The history stopped growing (" + view.history_failure + "); see the server's log. The comparison goes on."}));
    panel.appendChild(legend(view));
    panel.appendChild(heatmap(view, candidate));
    if (candidate.rows_not_kept) panel.appendChild(el("p", {className: "muted", text: candidate.rows_not_kept + " row(s) past the server's history_rows are not shown."}));
    return panel;
  }

  function legend(view) {
    var items = [[1, "≤ 0.001 of tolerance"], [85, "0.1"], [128, "at tolerance"], [129, "beyond"], [171, "×10"], [255, "≥ ×1000"], [0, "not compared"]];
    return el("div", {className: "legend"}, items.map(function (item) {
      return el("span", {}, [el("i", {style: "background:" + colour(item[0])}), item[1]]);
    }).concat([el("span", {className: "muted", text: "columns: the latest " + view.heatmap.steps_full_resolution + " steps one each, older ones merged (worst record); click a row to fold it"})]));
  }

  function collapseKey(run, row) { return run + "|" + row.phase + "|" + row.path; }

  function isCollapsed(view, candidate, row, index) {
    if (row.end <= index + 1) return false;         // a leaf
    var key = collapseKey(candidate.run, row);
    if (key in state.collapsed) return state.collapsed[key];
    var own = (view.candidates || []).filter(function (c) { return c.run === candidate.run; })[0];
    var d = own ? own.divergence : view.divergence;  // unfold the path to this candidate's own divergence
    if (d && d.first.candidate_run === candidate.run && d.first.phase === row.phase) {
      var target = d.first.module;
      if (row.path === "" || target === row.path || target.indexOf(row.path + ".") === 0) return false;
    }
    return row.depth >= 1 && row.end - index > 1 && row.depth >= 2;
  }

  function heatmap(view, candidate) {
    var rows = candidate.rows;
    var columns = candidate.columns;
    var nCols = columns.length;
    var cells = decode(candidate.cells);
    var metrics = decode(candidate.metric);
    var scale = view.heatmap.scale;
    var visible = [];
    for (var i = 0; i < rows.length;) {
      var collapsed = isCollapsed(view, candidate, rows[i], i);
      visible.push({index: i, collapsed: collapsed});
      i = collapsed ? rows[i].end : i + 1;
    }
    var wrap = el("div", {className: "heatmap-wrap"});
    var labels = el("div", {className: "heatmap-labels", style: "width:" + LABEL_W + "px"});
    var available = Math.max(200, (document.getElementById("app").clientWidth || 1000) - LABEL_W - 40);
    var cellW = Math.max(2, Math.min(24, Math.floor(available / Math.max(1, nCols))));
    var canvas = el("canvas", {className: "heatmap", "data-run": candidate.run, "data-columns": String(nCols),
                               "data-rows": String(visible.length)});
    var ratio = window.devicePixelRatio || 1;
    canvas.width = Math.max(1, nCols * cellW * ratio);
    canvas.height = Math.max(1, visible.length * ROW_H * ratio);
    canvas.style.width = (nCols * cellW) + "px";
    canvas.style.height = (visible.length * ROW_H) + "px";
    var ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    var shown = [];   // per visible row: codes and metric indices per column
    visible.forEach(function (v, y) {
      var row = rows[v.index];
      var codes = new Uint8Array(nCols), which = new Uint8Array(nCols).fill(255);
      var last = v.collapsed ? row.end : v.index + 1;
      for (var r = v.index; r < last; r++) {
        for (var c = 0; c < nCols; c++) {
          var code = cells[r * nCols + c];
          if (code > codes[c]) { codes[c] = code; which[c] = metrics[r * nCols + c]; }
        }
      }
      shown.push({row: row, codes: codes, metric: which, collapsed: v.collapsed});
      for (var c2 = 0; c2 < nCols; c2++) {
        ctx.fillStyle = colour(codes[c2]);
        ctx.fillRect(c2 * cellW, y * ROW_H, cellW - (cellW > 3 ? 1 : 0), ROW_H - 1);
      }
      var hasChildren = row.end > v.index + 1;
      var label = el("div", {className: "heatmap-label" + (row.depth === 0 ? " phase" : "") + (hasChildren ? " folder" : ""),
                             style: "height:" + ROW_H + "px;padding-left:" + (4 + 12 * row.depth) + "px",
                             title: row.phase + " · " + (row.path || "(model)") + (row.type ? " · " + row.type : ""),
                             "data-path": row.path, "data-phase": row.phase},
                       [(hasChildren ? (v.collapsed ? "▸ " : "▾ ") : "  ") + (row.depth === 0 ? row.phase : row.label)]);
      if (hasChildren) {
        label.addEventListener("click", function () {
          state.collapsed[collapseKey(candidate.run, row)] = !v.collapsed;
          renderView(state.view);
        });
      }
      labels.appendChild(label);
    });
    var tip = el("div", {className: "tooltip", hidden: true});
    canvas.addEventListener("mousemove", function (ev) {
      var rect = canvas.getBoundingClientRect();
      var c = Math.floor((ev.clientX - rect.left) / cellW), y = Math.floor((ev.clientY - rect.top) / ROW_H);
      if (c < 0 || c >= nCols || y < 0 || y >= shown.length) { tip.hidden = true; return; }
      var s = shown[y], code = s.codes[c], col = columns[c];
      var steps = col[0] === col[1] ? "step " + col[0] : "steps " + col[0] + "–" + col[1] + " (worst)";
      var what = code === 0 ? "not compared" :
        (s.metric[c] !== 255 ? view.heatmap.metrics[s.metric[c]] + " " : "") + "≈ " + fmt(ratioOf(code, scale), 2) + " × tolerance" + (code >= scale.over_from ? " — DIVERGED" : "");
      tip.textContent = s.row.phase + " · " + (s.row.path || "(model)") + (s.collapsed ? " (folded: worst below)" : "") + " · " + steps + " · " + what;
      tip.hidden = false;
      tip.style.left = (ev.clientX - rect.left + LABEL_W + 12) + "px";
      tip.style.top = (ev.clientY - rect.top + 12) + "px";
    });
    canvas.addEventListener("mouseleave", function () { tip.hidden = true; });
    var axis = el("div", {className: "heatmap-axis", style: "margin-left:" + LABEL_W + "px;width:" + (nCols * cellW) + "px"}, [
      el("span", {text: nCols ? "step " + columns[0][0] : ""}), el("span", {text: nCols ? "step " + columns[nCols - 1][1] : ""}),
    ]);
    wrap.appendChild(labels);
    wrap.appendChild(canvas);
    wrap.appendChild(tip);
    return el("div", {}, [wrap, axis]);
  }

  // -- the curves ------------------------------------------------------------------------------

  function updateCurves(view) {
    var slot = document.getElementById("curves-slot");
    var key = JSON.stringify(view.curves.map(function (c) { return [c.run, !!c.noise]; }));
    if (slot.dataset.key !== key) {   // other runs or bands: charts made afresh
      state.charts.forEach(function (entry) { entry.chart.destroy(); });
      state.charts = [];
      slot.dataset.key = key;
      fill("curves-slot", curvesPanel(view));
      return;
    }
    var k = 0;
    view.curves.forEach(function (curve) {
      curveSeries(curve, view).forEach(function (spec) {
        var entry = state.charts[k++];
        if (entry) entry.chart.setData([spec.x].concat(spec.series.map(function (s) { return s[1]; })));
      });
    });
  }

  function curveSeries(curve, view) {
    var baseline = (view.progress.filter(function (p) { return p.role === "baseline"; })[0] || {}).run || "baseline";
    var x = curve.first_step.map(function (f, k) { return (f + curve.last_step[k]) / 2; });
    var noise = curve.noise;
    var k = noise ? noise.multiple : 0;
    function band(values, sign) { return values.map(function (v) { return v === null ? null : sign * k * v; }); }
    return [
      {title: "loss", x: x, series: [[baseline, curve.baseline_loss, "#1565c0"], [curve.run, curve.loss, "#d84315"]]},
      {title: "loss difference (" + curve.run + " − " + baseline + ")", x: x, band: !!noise,
       series: [["difference", curve.loss_diff, "#6a1b9a"]].concat(noise ? [["+" + k + "× noise", band(noise.loss, 1), "#90a4ae"], ["−" + k + "× noise", band(noise.loss, -1), "#90a4ae"]] : [])},
      {title: "global gradient norm", x: x, series: [[baseline, curve.baseline_grad_norm, "#1565c0"], [curve.run, curve.grad_norm, "#d84315"]]},
      {title: "gradient norm, relative difference", x: x, band: !!noise,
       series: [["relative difference", curve.grad_norm_rel_diff, "#6a1b9a"]].concat(noise ? [["+" + k + "× noise", band(noise.grad_norm_rel, 1), "#90a4ae"], ["−" + k + "× noise", band(noise.grad_norm_rel, -1), "#90a4ae"]] : [])},
    ];
  }

  function curvesPanel(view) {
    var panel = el("section", {className: "panel", id: "curves"}, [el("h2", {text: "Loss and global gradient norm"})]);
    if (!view.curves.length) {
      panel.appendChild(el("p", {className: "muted", text: view.history_kept ? "No step compared yet." : "Not kept (see above)."}));
      return panel;
    }
    var baseline = (view.progress.filter(function (p) { return p.role === "baseline"; })[0] || {}).run || "baseline";
    view.curves.forEach(function (curve) {
      var grid = el("div", {className: "charts", "data-run": curve.run});
      panel.appendChild(el("h3", {text: "candidate " + curve.run + " against " + baseline + (curve.noise ? " (noise band: " + curve.noise.multiple + " × the reference run " + curve.noise.reference_run + "'s difference)" : "")}));
      panel.appendChild(grid);
      curveSeries(curve, view).forEach(function (spec) { chart(grid, spec); });
    });
    return panel;
  }

  function chart(parent, spec) {
    var box = el("div", {className: "chart"});
    parent.appendChild(box);
    if (typeof uPlot === "undefined") { box.textContent = spec.title + ": the chart library did not load"; return; }
    var width = Math.max(260, Math.floor(((document.getElementById("app").clientWidth || 1000) - 100) / 2));
    var opts = {
      title: spec.title, width: width, height: 190,
      scales: {x: {time: false}},
      axes: [{values: function (u, ticks) { return ticks.map(function (v) { return Number.isInteger(v) ? String(v) : ""; }); }},
             {size: 72, values: function (u, ticks) { return ticks.map(function (v) { return fmt(v, 2); }); }}],
      series: [{label: "step"}].concat(spec.series.map(function (s, i) {
        return {label: s[0], stroke: s[2], width: i === 0 ? 2 : 1, dash: spec.band && i > 0 ? [4, 4] : undefined,
                points: {show: function (u) { return u.data[0].length < 60; }}};
      })),
    };
    if (spec.band) opts.bands = [{series: [2, 3], fill: "rgba(144,164,174,0.25)"}];
    var data = [spec.x].concat(spec.series.map(function (s) { return s[1]; }));
    state.charts.push({chart: new uPlot(opts, data, box)});
  }

  // -- polling ---------------------------------------------------------------------------------

  function schedule() {
    clearTimeout(state.timer);
    if (document.hidden) return;   // resumed by visibilitychange
    state.timer = setTimeout(refresh, POLL_MS);
  }

  function failed(message) {
    var fresh = document.getElementById("freshness");
    fresh.textContent = message;
    fresh.className = "bad";
  }

  function refresh() {
    if (PAGE === "sessions") {
      api("/api/sessions").then(function (response) {
        if (response.ok) return response.json().then(function (data) { renderSessions(data); });
        return errorText(response).then(function (text) { if (response.status === 401 || response.status === 403) askToken(text); else failed(text); });
      }).catch(function (err) { failed("server unreachable: " + err); }).then(schedule);
      return;
    }
    var options = {headers: state.etag ? {"If-None-Match": state.etag} : {}};
    api(sessionPath(SESSION) + "/view", options).then(function (response) {
      if (response.status === 304) { document.getElementById("freshness").className = ""; return; }
      if (response.ok) {
        state.etag = response.headers.get("ETag");
        return response.json().then(function (view) {
          state.view = view;
          document.getElementById("freshness").className = "";
          renderView(view);
        });
      }
      return errorText(response).then(function (text) {
        if (response.status === 401 || response.status === 403) askToken(text); else failed(text);
      });
    }).catch(function (err) { failed("server unreachable: " + err); }).then(schedule);
  }

  document.addEventListener("visibilitychange", function () { if (!document.hidden && MODE === "live") refresh(); });

  function start() {
    if (MODE === "frozen") {
      var brand = document.getElementById("brand");
      brand.removeAttribute("href");
      state.view = JSON.parse(document.getElementById("twinstep-view").textContent);
      renderView(state.view);
      return;
    }
    fetch("/api/info", {cache: "no-store", credentials: "omit"}).then(function (r) { return r.json(); }).then(function (info) {
      state.info = info;
      showTokenStatus();
      if (info.auth_required && !token()) { askToken(""); return; }
      refresh();
    }).catch(function (err) { failed("server unreachable: " + err); });
  }

  window.twinstepDashboard = state;   // for people (and tests) looking at the page's state
  start();
})();
