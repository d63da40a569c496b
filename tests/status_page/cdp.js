// Drives headless Chromium over its DevTools protocol for the status page test.
// Usage: node --experimental-websocket cdp.js CHROMIUM URL USER_DATA_DIR
// Then commands on stdin, one a line; each answer is one JSON line on stdout:
//   dom                  -> {"html": "<html>…"}          (the rendered DOM, after scripts)
//   shot PATH            -> {"ok": true}                  (a PNG screenshot of the page)
//   eval JSON-STRING     -> {"value": …}                  (an expression in the page, awaited)
//   quit
"use strict";
const { spawn } = require("child_process");
const fs = require("fs");
const path = require("path");
const readline = require("readline");

const [chromium, url, dataDir] = process.argv.slice(2);
const browser = spawn(chromium, [
  "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync",
  "--user-data-dir=" + dataDir, "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
  "--window-size=1280,900", "about:blank",
], { stdio: ["ignore", "ignore", "pipe"] });
let stderr = "";
browser.stderr.on("data", (d) => { stderr += d; });

function fail(msg) {
  process.stdout.write(JSON.stringify({ error: msg, stderr: stderr.slice(-2000) }) + "\n");
  browser.kill("SIGKILL");
  process.exit(1);
}

async function devtoolsPort() {
  const file = path.join(dataDir, "DevToolsActivePort");
  for (let i = 0; i < 300; i++) {
    if (fs.existsSync(file)) {
      const lines = fs.readFileSync(file, "utf8").split("\n");
      if (lines.length >= 2 && lines[1]) return [lines[0], lines[1]];
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  fail("chromium did not open its DevTools port");
}

async function main() {
  const [port, wsPath] = await devtoolsPort();
  const ws = new WebSocket("ws://127.0.0.1:" + port + wsPath);
  await new Promise((res, rej) => { ws.onopen = res; ws.onerror = () => rej(new Error("ws")); });
  let id = 0;
  const pending = new Map();
  ws.onmessage = (m) => {
    const msg = JSON.parse(m.data);
    if (msg.id && pending.has(msg.id)) {
      const { res, rej } = pending.get(msg.id);
      pending.delete(msg.id);
      if (msg.error) rej(new Error(JSON.stringify(msg.error))); else res(msg.result);
    }
  };
  const send = (method, params = {}, sessionId) => new Promise((res, rej) => {
    id += 1;
    pending.set(id, { res, rej });
    ws.send(JSON.stringify({ id, method, params, sessionId }));
  });
  const { targetId } = await send("Target.createTarget", { url: "about:blank" });
  const { sessionId } = await send("Target.attachToTarget", { targetId, flatten: true });
  await send("Page.enable", {}, sessionId);
  await send("Emulation.setDeviceMetricsOverride", { width: 1280, height: 900, deviceScaleFactor: 1, mobile: false }, sessionId);
  await send("Page.navigate", { url }, sessionId);
  // Until the page has loaded (its scripts then fetch and render on their own).
  for (let i = 0; i < 300; i++) {
    const r = await send("Runtime.evaluate", { expression: "location.href !== 'about:blank' && document.readyState === 'complete'", returnByValue: true }, sessionId);
    if (r.result.value === true) break;
    await new Promise((res) => setTimeout(res, 100));
  }
  const rl = readline.createInterface({ input: process.stdin });
  for await (const line of rl) {
    const t = line.trim();
    const sp = t.indexOf(" ");
    const [cmd, arg] = sp < 0 ? [t, ""] : [t.slice(0, sp), t.slice(sp + 1)];
    try {
      if (cmd === "dom") {
        const r = await send("Runtime.evaluate", { expression: "document.documentElement.outerHTML", returnByValue: true }, sessionId);
        process.stdout.write(JSON.stringify({ html: r.result.value }) + "\n");
      } else if (cmd === "eval") {
        const r = await send("Runtime.evaluate", { expression: JSON.parse(arg), awaitPromise: true, returnByValue: true }, sessionId);
        if (r.exceptionDetails) throw new Error(JSON.stringify(r.exceptionDetails).slice(0, 1000));
        process.stdout.write(JSON.stringify({ value: r.result.value === undefined ? null : r.result.value }) + "\n");
      } else if (cmd === "shot") {
        const r = await send("Page.captureScreenshot", { format: "png", captureBeyondViewport: true }, sessionId);
        fs.writeFileSync(arg, Buffer.from(r.data, "base64"));
        process.stdout.write(JSON.stringify({ ok: true }) + "\n");
      } else if (cmd === "quit") {
        break;
      }
    } catch (e) {
      process.stdout.write(JSON.stringify({ error: String(e) }) + "\n");
    }
  }
  browser.kill("SIGKILL");
  process.exit(0);
}

main().catch((e) => fail(String(e)));
