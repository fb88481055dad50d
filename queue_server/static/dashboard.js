// roadlog's dashboard: the latest heat map of a topic on a street map,
// followed without a reload (the heat map's ETag is polled), and the
// cluster. Everything it loads comes from this queue server.
/* global L */
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const body = document.body;
  const params = new URLSearchParams(location.search);
  // The page's client identity (issue 19): a token given to it in the
  // fragment (#token=..., never sent to the server in a URL; kept in
  // localStorage), else the one kept from before, else, where the queue
  // server lets phones register (POST /v1/clients), one it registers for
  // itself and keeps. Give-to-get applies to it like to any client.
  const TOKEN = "roadlog.token";
  const SOURCE = "roadlog.token_source"; // "given" or "registered"
  const fragment = new URLSearchParams(location.hash.slice(1));
  const givenNow = fragment.get("token") || "";
  if (givenNow) {
    localStorage.setItem(TOKEN, givenNow);
    localStorage.setItem(SOURCE, "given");
    history.replaceState(null, "", location.pathname + location.search);
  }
  // A token put in the address of the open page: start again with it.
  window.addEventListener("hashchange", () => {
    if (new URLSearchParams(location.hash.slice(1)).get("token")) location.reload();
  });
  const state = {
    config: { tile_url: "", poll_ms: 2000, client_auth: "token", registration: false },
    token: localStorage.getItem(TOKEN) || "",
    tokenSource: localStorage.getItem(SOURCE) || "given",
    identity: null, // {name, client_id, scopes} once the cluster knows the token
    topic: params.get("topic") || "",
    client: params.get("client_id") || localStorage.getItem("roadlog.client_id") || "",
    etag: null, // of the map shown
    windows: [],
    selected: 0, // a window's start; 0 follows the latest
    shown: null, // the properties of the map shown
    updates: 0,
    cells: new Map(), // h3 -> {layer, props}
  };
  const auth = () => (state.token ? { Authorization: `Bearer ${state.token}` } : {});
  window.roadlogDashboard = state; // for tests and the curious

  // ------------------------------------------------------------ the map
  const map = L.map("map", { zoomControl: true, preferCanvas: false }).setView([48.137, 11.575], 12);
  state.map = map;
  let regionLayer = null;
  let cellLayer = null;
  let tiles = null;

  function plainBackground(why) {
    if (tiles) {
      map.removeLayer(tiles);
      tiles = null;
    }
    $("map").classList.add("plain");
    map.attributionControl.setPrefix(why);
  }

  function addTiles(url) {
    if (!url || params.get("tiles") === "off") {
      plainBackground("no street map (plain background)");
      return;
    }
    const osm = /openstreetmap\.org/.test(url);
    tiles = L.tileLayer(url, {
      maxZoom: 19,
      attribution: osm ? '&copy; <a href="https://www.openstreetmap.org/copyright">OpenStreetMap</a> contributors' : "",
    });
    let loaded = 0;
    let failed = 0;
    tiles.on("tileload", () => { loaded++; });
    tiles.on("tileerror", () => {
      failed++;
      if (loaded === 0 && failed >= 4) plainBackground("street map unreachable (plain background)");
    });
    tiles.addTo(map);
  }

  const STOPS = [[0, [26, 152, 80]], [0.25, [145, 207, 96]], [0.5, [254, 224, 139]],
    [0.75, [252, 141, 89]], [1, [215, 48, 39]]];

  function colour(congestion) {
    if (congestion === null || congestion === undefined) return "#9e9e9e";
    const c = Math.max(0, Math.min(1, congestion));
    for (let i = 1; i < STOPS.length; i++) {
      const [b, cb] = STOPS[i];
      const [a, ca] = STOPS[i - 1];
      if (c <= b) {
        const t = (c - a) / (b - a);
        const mix = ca.map((v, k) => Math.round(v + (cb[k] - v) * t));
        return `rgb(${mix[0]}, ${mix[1]}, ${mix[2]})`;
      }
    }
    return "rgb(215, 48, 39)";
  }

  const kmh = (mps) => (mps === null || mps === undefined ? "-" : `${(mps * 3.6).toFixed(1)} km/h`);
  const pct = (x) => (x === null || x === undefined ? "-" : `${Math.round(x * 100)} %`);

  function figures(p) {
    return `<dl><dt>cell</dt><dd>${p.h3}</dd><dt>pings</dt><dd>${p.pings}</dd>` +
      `<dt>devices</dt><dd>${p.devices}</dd><dt>mean speed</dt><dd>${kmh(p.mean_speed_mps)}</dd>` +
      `<dt>free flow</dt><dd>${kmh(p.free_flow_mps)}</dd>` +
      `<dt>congestion</dt><dd>${pct(p.congestion)}</dd></dl>`;
  }

  function utc(ms, withDate) {
    const iso = new Date(ms).toISOString();
    return withDate ? `${iso.slice(0, 10)} ${iso.slice(11, 16)}` : iso.slice(11, 16);
  }

  function draw(doc, fit) {
    const props = doc.properties;
    const pings = doc.features.map((f) => f.properties.pings).sort((a, b) => a - b);
    const top = Math.max(1, pings.length ? pings[Math.floor(0.95 * (pings.length - 1))] : 1);
    if (cellLayer) map.removeLayer(cellLayer);
    if (regionLayer) map.removeLayer(regionLayer);
    state.cells = new Map();
    regionLayer = L.geoJSON(props.region, {
      style: { color: "#335", weight: 2, dashArray: "6 4", fill: false },
      interactive: false,
    }).addTo(map);
    cellLayer = L.geoJSON(doc, {
      style: (f) => ({
        color: colour(f.properties.congestion),
        weight: 0.5,
        fillColor: colour(f.properties.congestion),
        fillOpacity: 0.25 + 0.7 * Math.min(1, f.properties.pings / top),
      }),
      onEachFeature: (f, layer) => {
        layer.bindTooltip(figures(f.properties), { sticky: true, className: "cell-tip" });
        layer.on("mouseover", () => { $("cell").innerHTML = "<h2>Cell</h2>" + figures(f.properties); });
        state.cells.set(f.properties.h3, { layer, props: f.properties });
      },
    }).addTo(map);
    for (const [h3, c] of state.cells) {
      const el = c.layer.getElement && c.layer.getElement();
      if (el) el.setAttribute("data-h3", h3);
    }
    if (fit) map.fitBounds(regionLayer.getBounds(), { padding: [10, 10] });
    state.shown = props;
    state.windows = props.windows;
    state.updates++;
    $("window").textContent =
      `window ${utc(props.window_start_ms, true)}-${utc(props.window_end_ms)} UTC · ` +
      `${doc.features.length} cells, ${props.source_pings.toLocaleString("en")} pings · ` +
      `computed ${new Date(props.computed_ms).toISOString().slice(11, 19)} UTC`;
    timeline();
    body.dataset.state = "ok";
    body.dataset.topic = props.topic;
    body.dataset.window = String(props.window_start_ms);
    body.dataset.cells = String(doc.features.length);
    body.dataset.updates = String(state.updates);
  }

  function timeline() {
    const s = $("slider");
    const w = state.windows;
    s.max = String(Math.max(0, w.length - 1));
    s.disabled = w.length < 2;
    const shown = state.shown ? w.indexOf(state.shown.window_start_ms) : -1;
    s.value = String(shown >= 0 ? shown : w.length - 1);
    $("slider-label").textContent = w.length
      ? `${shown + 1} of the newest ${w.length} windows` + (state.selected ? " (paused)" : " (live)")
      : "";
    $("live").disabled = !state.selected;
  }

  function notice(text, kind) {
    const n = $("notice");
    n.hidden = !text;
    n.textContent = text || "";
    n.className = kind || "";
  }

  // ------------------------------------------------------------ polling
  let inFlight = false;
  let fitNext = true;

  async function pollMap() {
    if (inFlight || !state.topic) return;
    inFlight = true;
    try {
      const q = new URLSearchParams({ topic: state.topic });
      if (state.config.client_auth === "none" && state.client) q.set("client_id", state.client);
      if (state.selected) q.set("window_start_ms", String(state.selected));
      const headers = state.etag ? { ...auth(), "If-None-Match": state.etag } : auth();
      const r = await fetch(`/ui/api/heatmap?${q}`, { headers, cache: "no-store" });
      if (r.status === 304) return;
      if (r.ok) {
        const doc = await r.json();
        state.etag = r.headers.get("ETag");
        notice("");
        draw(doc, fitNext);
        fitNext = false;
        return;
      }
      state.etag = null;
      let reason = `HTTP ${r.status}`;
      try {
        reason = (await r.json()).error.reason;
      } catch (e) { /* not JSON */ }
      if (r.status === 403) {
        body.dataset.state = "denied";
        const own = state.tokenSource === "registered" ?
          " This page's own identity has sent no pings there; to see the map, open the page with " +
          "#token=TOKEN of the identity you publish with." : "";
        notice(`Not allowed: ${reason}${own}`, "denied");
      } else if (r.status === 401) {
        body.dataset.state = "unauthenticated";
        notice(`The cluster no longer accepts this page's token: ${reason}`, "denied");
      } else if (r.status === 404) {
        body.dataset.state = "none";
        notice(reason);
      } else {
        body.dataset.state = "error";
        notice(`The heat map could not be read: ${reason}`);
      }
    } catch (e) {
      body.dataset.state = "error";
      notice(`The queue server does not answer (${e.message}); trying again.`);
    } finally {
      inFlight = false;
    }
  }

  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }

  async function pollCluster() {
    let st;
    try {
      const r = await fetch("/ui/api/cluster", { headers: auth(), cache: "no-store" });
      if (!r.ok) return;
      st = await r.json();
    } catch (e) {
      return;
    }
    const nodes = $("nodes").tBodies[0];
    nodes.replaceChildren();
    for (const n of st.nodes) {
      const tr = document.createElement("tr");
      if (n.id === st.leader) tr.className = "leader";
      if (n.role === "down") tr.className = "down";
      tr.append(cell(`${n.id}`), cell(n.role), cell(n.term, "num"), cell(n.commit_index, "num"),
        cell(n.applied_index, "num"), cell(n.lag, "num"), cell(n.ready ? "yes" : "no"));
      tr.title = `${n.address} · ${n.version || "a release from before versions were told"}`;
      nodes.append(tr);
    }
    const groups = $("groups").tBodies[0];
    groups.replaceChildren();
    for (const g of st.groups || []) {
      const tr = document.createElement("tr");
      if (!g.leader) tr.className = "down";
      const lag = g.replicas.map((r) => `n${r.node} ${r.lag}`).join(", ") || "-";
      tr.append(cell(g.id === 0 ? "0 (metadata)" : `${g.id}`), cell(g.leader || "none"),
        cell(g.term, "num"), cell(g.commit_index, "num"), cell(lag));
      tr.title = g.replicas.map((r) => `node ${r.node}: ${r.role}, applied ${r.applied_index}`)
        .join("; ");
      groups.append(tr);
    }
    body.dataset.groups = String((st.groups || []).length);
    const qs = $("queues");
    qs.replaceChildren();
    for (const q of st.queue_servers) {
      const li = document.createElement("li");
      li.textContent = q.grpc + (q.http ? ` (HTTP ${q.http})` : "") +
        (q.version ? ` · ${q.version}` : "");
      qs.append(li);
    }
    const topics = $("topics").tBodies[0];
    topics.replaceChildren();
    const select = $("topic");
    const names = st.topics.map((t) => t.name);
    if (names.join() !== Array.from(select.options).map((o) => o.value).join()) {
      select.replaceChildren(...names.map((n) => new Option(n, n)));
    }
    for (const t of st.topics) {
      const tr = document.createElement("tr");
      const rate = t.ingest_pings_per_s === null ? "-" :
        `${t.ingest_pings_per_s.toFixed(1)}` + (t.ingest_over_s < 55 ? ` (${Math.round(t.ingest_over_s)} s)` : "");
      tr.append(cell(t.name), cell(t.partitions, "num"), cell(t.pings.toLocaleString("en"), "num"),
        cell(rate, "num"));
      topics.append(tr);
    }
    if (!state.topic && names.length) {
      state.topic = names[0];
      pollMap();
    }
    select.value = state.topic;
    $("cluster-time").textContent = `leader ${st.leader || "none"}, term ${st.term} · ` +
      `as of ${new Date(st.served_ms).toISOString().slice(11, 19)} UTC`;
    body.dataset.nodes = String(st.nodes.length);
  }

  // ------------------------------------------------------------ controls
  $("client").value = state.client;
  $("client").addEventListener("change", (e) => {
    state.client = e.target.value.trim();
    localStorage.setItem("roadlog.client_id", state.client);
    state.etag = null;
    pollMap();
  });
  $("topic").addEventListener("change", (e) => {
    state.topic = e.target.value;
    state.selected = 0;
    state.etag = null;
    fitNext = true;
    pollMap();
  });
  $("slider").addEventListener("input", (e) => {
    const i = Number(e.target.value);
    state.selected = i >= state.windows.length - 1 ? 0 : state.windows[i];
    state.etag = null;
    pollMap();
  });
  $("live").addEventListener("click", () => {
    state.selected = 0;
    state.etag = null;
    pollMap();
  });

  async function reasonOf(r) {
    try {
      return (await r.json()).error.reason;
    } catch (e) {
      return `HTTP ${r.status}`;
    }
  }

  function showIdentity() {
    const el = $("identity");
    const id = state.identity;
    if (state.config.client_auth === "none") {
      el.textContent = "no identities on this cluster (client_auth none)";
      $("client-box").hidden = false;
      return;
    }
    if (!id) {
      el.textContent = "no identity";
      return;
    }
    const how = state.tokenSource === "registered" ? "registered by this page" : "token given";
    el.replaceChildren("identity ", Object.assign(document.createElement("b"), {
      textContent: id.name || id.client_id,
    }), ` ${id.client_id} · ${how}`);
    el.title = `scopes: ${(id.scopes || []).join(" ")}`;
    body.dataset.client = id.client_id;
    body.dataset.identity = state.tokenSource;
  }

  function keep(token, source) {
    state.token = token;
    state.tokenSource = source;
    if (token) {
      localStorage.setItem(TOKEN, token);
      localStorage.setItem(SOURCE, source);
    } else {
      localStorage.removeItem(TOKEN);
      localStorage.removeItem(SOURCE);
    }
  }

  // The identity to ask with; false (and a notice) when the page has none.
  async function identify() {
    if (state.config.client_auth === "none") {
      showIdentity();
      if (!state.client) notice("Heat maps are for those who contribute: give the client id you publish pings with.");
      return true;
    }
    if (state.token) {
      const r = await fetch("/ui/api/identity", { headers: auth(), cache: "no-store" });
      if (r.ok) {
        state.identity = await r.json();
        showIdentity();
        return true;
      }
      const reason = await reasonOf(r);
      if (r.status !== 401 || givenNow) {
        // a token given now that the cluster does not know: said, not replaced
        body.dataset.state = "unauthenticated";
        notice(`This page's token is not accepted: ${reason}`, "denied");
        return false;
      }
      keep("", ""); // kept from before, unknown here (another cluster's, or revoked)
    }
    if (!state.config.registration) {
      body.dataset.state = "unauthenticated";
      notice("This page has no client identity, and this queue server does not register any " +
        "(open_registration is off): open it with #token=TOKEN (roadlog client create ...).", "denied");
      showIdentity();
      return false;
    }
    const r = await fetch("/v1/clients", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: "{}", cache: "no-store",
    });
    if (!r.ok) {
      body.dataset.state = "unauthenticated";
      notice(`This page could not register a client identity: ${await reasonOf(r)}`, "denied");
      return false;
    }
    const got = await r.json();
    keep(got.token, "registered");
    state.identity = { name: "", client_id: got.client_id, scopes: got.scopes };
    try {
      const who = await fetch("/ui/api/identity", { headers: auth(), cache: "no-store" });
      if (who.ok) state.identity = await who.json();
    } catch (e) { /* the registration's answer will do */ }
    showIdentity();
    return true;
  }

  async function start() {
    try {
      const r = await fetch("/ui/api/config", { cache: "no-store" });
      if (r.ok) state.config = await r.json();
    } catch (e) { /* the defaults */ }
    addTiles(state.config.tile_url);
    let known = false;
    try {
      known = await identify();
    } catch (e) {
      notice(`The queue server does not answer (${e.message}).`);
    }
    await pollCluster();
    if (known) await pollMap();
    setInterval(() => { if (known) pollMap(); }, state.config.poll_ms);
    setInterval(pollCluster, Math.max(2000, state.config.poll_ms * 2));
  }
  start();
})();
