// A proxy-aware HTTPS client for the interception tests, on node's own modules only: Node's
// fetch does not honour HTTPS_PROXY by itself (and Debian's node-undici is another major than
// the undici inside this node), so this does what a proxy agent does: `CONNECT` with node's
// http, then tls.connect over that socket (trusting the default roots plus NODE_EXTRA_CA_CERTS),
// then HTTP/1.1 (http.request) or h2 (http2.connect) on it.
//
// usage: node client.js h1|h2 METHOD URL [HEADER=VALUE ...]
// prints one JSON line: {status, headers, body}
'use strict';
const http = require('http');
const http2 = require('http2');
const tls = require('tls');

const [mode, method, url, ...hdrs] = process.argv.slice(2);
const target = new URL(url);
// EGRESS_TEST_CONNECT_TO=ip:port: no proxy, connect straight there (where the kernel would
// redirect a program that ignores the proxy variables), the URL's name as SNI and Host.
const direct = process.env.EGRESS_TEST_CONNECT_TO;
const proxy = direct ? null : new URL(process.env.HTTPS_PROXY || process.env.https_proxy);
const headers = {};
for (const h of hdrs) {
  const i = h.indexOf('=');
  headers[h.slice(0, i)] = h.slice(i + 1);
}
const authority = `${target.hostname}:${target.port || 443}`;

function fail(e) {
  console.log(JSON.stringify({ error: String(e && e.code || e) }));
  process.exit(2);
}

function onSocket(socket) {
  const sock = tls.connect({
    socket,
    servername: target.hostname,
    ALPNProtocols: mode === 'h2' ? ['h2'] : ['http/1.1'],
  });
  sock.on('error', fail);
  sock.on('secureConnect', () => (mode === 'h2' ? viaH2(sock) : viaH1(sock)));
}

if (direct) {
  const i = direct.lastIndexOf(':');
  const raw = require('net').connect({ host: direct.slice(0, i), port: Number(direct.slice(i + 1)) });
  raw.on('error', fail);
  raw.on('connect', () => onSocket(raw));
} else {
  startConnect();
}

function startConnect() {
const connect = http.request({
  host: proxy.hostname,
  port: proxy.port,
  method: 'CONNECT',
  path: authority,
  headers: { host: authority },
});
connect.on('error', fail);
connect.on('connect', (res, socket) => {
  if (res.statusCode !== 200) fail(`CONNECT ${res.statusCode}`);
  onSocket(socket);
});
connect.end();
}

function done(status, h, chunks) {
  console.log(JSON.stringify({ status, headers: h, body: Buffer.concat(chunks).toString() }));
  process.exit(0);
}

function viaH1(sock) {
  const req = http.request({
    createConnection: () => sock,
    method,
    path: target.pathname + target.search,
    headers: { ...headers, host: target.host },
  });
  req.on('error', fail);
  req.on('response', (res) => {
    const chunks = [];
    res.on('data', (c) => chunks.push(c));
    res.on('end', () => done(res.statusCode, res.headers, chunks));
  });
  req.end();
}

function viaH2(sock) {
  const session = http2.connect(`https://${target.host}`, { createConnection: () => sock });
  session.on('error', fail);
  const req = session.request({
    ':method': method,
    ':path': target.pathname + target.search,
    ...headers,
  });
  req.on('error', fail);
  let status = 0;
  let h = {};
  req.on('response', (rh) => {
    status = rh[':status'];
    h = rh;
  });
  const chunks = [];
  req.on('data', (c) => chunks.push(c));
  req.on('end', () => {
    session.close();
    done(status, h, chunks);
  });
  req.end();
}
