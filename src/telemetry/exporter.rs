//! The `/metrics` HTTP endpoint: its configuration (`RAILOVER_METRICS_PORT`,
//! `RAILOVER_METRICS_ADDR`, the local rank) and a small non-blocking server on one
//! joinable thread.
//!
//! The exporter crate's own listener runs on tokio and cannot be joined, and NCCL may
//! `dlclose` the library right after the last `finalize`; so this thread waits in
//! `mio::Poll` on the listening socket, its connections and a `Waker`, and
//! [`Exporter::shutdown`] wakes and joins it. Connections are served concurrently and
//! never block the thread: at most [`MAX_CONNECTIONS`] are open, each gets
//! [`CONNECTION_DEADLINE`] from accept to the end of its answer, and when a new one
//! arrives at the limit the one that has waited longest without a complete request is
//! closed, so idle or slow clients cannot keep a scrape out.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::PrometheusHandle;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;

use crate::config::{strict_u64, ConfigError, EnvReader};

/// The base port variable: an integer, or `off`.
pub const PORT_VAR: &str = "RAILOVER_METRICS_PORT";
/// The bind address variable.
pub const ADDR_VAR: &str = "RAILOVER_METRICS_ADDR";
/// Base port when [`PORT_VAR`] is unset (the OpenTelemetry Prometheus exporter's port).
pub const DEFAULT_PORT: u16 = 9464;
/// Bind address when [`ADDR_VAR`] is unset: every interface, so Prometheus can scrape from
/// another host.
pub const DEFAULT_ADDR: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
/// Where the local rank is read from, first set wins: torchrun/accelerate, Open MPI, Slurm.
pub const LOCAL_RANK_VARS: [&str; 3] =
    ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"];

const PORT_ACCEPTED: &str =
    "off, or a base port from 0 to 65535 to which the local rank is added (0: any free port)";
const ADDR_ACCEPTED: &str = "an IPv4 or IPv6 address to bind, e.g. 0.0.0.0, 127.0.0.1 or ::";
const RANK_ACCEPTED: &str = "a local rank from 0 to 65535";

/// Connections open at once; a new one past this closes the longest-waiting idle one.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a connection may take from accept to the end of its answer.
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(5);
/// How often histograms are upkept when nobody scrapes.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);
/// Longest request head read (request line and headers).
const MAX_HEAD: usize = 8 * 1024;

/// Parsed metrics-endpoint settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExporterConfig {
    /// `None`: `RAILOVER_METRICS_PORT=off`.
    pub endpoint: Option<EndpointConfig>,
    /// From [`LOCAL_RANK_VARS`], whether or not there is an endpoint: `railover status`
    /// shows it too.
    pub local_rank: Option<u16>,
}

/// Where the endpoint binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointConfig {
    pub addr: IpAddr,
    /// The local rank is added to it; 0 means any free port (rank ignored).
    pub base_port: u16,
    /// From [`LOCAL_RANK_VARS`]; when absent the device ordinal given to `start` is used.
    pub local_rank: Option<u16>,
}

impl Default for ExporterConfig {
    fn default() -> Self {
        ExporterConfig {
            endpoint: Some(EndpointConfig {
                addr: DEFAULT_ADDR,
                base_port: DEFAULT_PORT,
                local_rank: None,
            }),
            local_rank: None,
        }
    }
}

impl ExporterConfig {
    /// No endpoint; metrics are still recorded and renderable.
    pub fn off() -> Self {
        ExporterConfig {
            endpoint: None,
            local_rank: None,
        }
    }

    /// Reads the process environment. A value that is not UTF-8 is an error, not unset.
    pub fn from_env() -> Result<Self, ConfigError> {
        let env = EnvReader::default();
        let parsed = Self::from_lookup(|k| env.get(k));
        env.finish(parsed)
    }

    /// Parses from any key lookup (tests pass a map).
    pub fn from_lookup(get: impl Fn(&'static str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut endpoint = EndpointConfig {
            addr: DEFAULT_ADDR,
            base_port: DEFAULT_PORT,
            local_rank: None,
        };
        // Every variable is checked even when the endpoint is off: a bad value is an error
        // whether or not it is used today.
        let mut off = false;
        // Strict, as every variable: plain decimal numbers, no surrounding blanks.
        if let Some(v) = get(PORT_VAR) {
            if v.eq_ignore_ascii_case("off") {
                off = true;
            } else {
                endpoint.base_port = strict_u64(&v)
                    .and_then(|n| u16::try_from(n).ok())
                    .ok_or_else(|| ConfigError {
                        var: PORT_VAR,
                        value: v.clone(),
                        accepted: PORT_ACCEPTED,
                    })?;
            }
        }
        if let Some(v) = get(ADDR_VAR) {
            endpoint.addr = v.parse().map_err(|_| ConfigError {
                var: ADDR_VAR,
                value: v.clone(),
                accepted: ADDR_ACCEPTED,
            })?;
        }
        if let Some((var, v)) = LOCAL_RANK_VARS
            .iter()
            .find_map(|&var| get(var).map(|v| (var, v)))
        {
            let rank = strict_u64(&v)
                .and_then(|n| u16::try_from(n).ok())
                .ok_or_else(|| ConfigError {
                    var,
                    value: v.clone(),
                    accepted: RANK_ACCEPTED,
                })?;
            if !off
                && endpoint.base_port != 0
                && u32::from(endpoint.base_port) + u32::from(rank) > 65535
            {
                return Err(ConfigError {
                    var: PORT_VAR,
                    value: get(PORT_VAR).unwrap_or_else(|| DEFAULT_PORT.to_string()),
                    accepted: "a base port that stays at most 65535 after adding the local rank",
                });
            }
            endpoint.local_rank = Some(rank);
        }
        Ok(ExporterConfig {
            local_rank: endpoint.local_rank,
            endpoint: (!off).then_some(endpoint),
        })
    }

    /// The address to bind: base port + local rank (else `device_ordinal`, else 0), or
    /// `Ok(None)` when off. `Err` says why no port fits (a device ordinal past 65535).
    pub fn socket_addr(&self, device_ordinal: Option<u32>) -> Result<Option<SocketAddr>, String> {
        let Some(e) = self.endpoint else {
            return Ok(None);
        };
        if e.base_port == 0 {
            return Ok(Some(SocketAddr::new(e.addr, 0)));
        }
        let offset = e.local_rank.map(u32::from).or(device_ordinal).unwrap_or(0);
        let port = u32::from(e.base_port) + offset;
        let port = u16::try_from(port)
            .map_err(|_| format!("port {} + {offset} is past 65535", e.base_port))?;
        Ok(Some(SocketAddr::new(e.addr, port)))
    }
}

impl std::fmt::Display for ExporterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.endpoint {
            None => write!(f, "metrics=off"),
            Some(e) => write!(f, "metrics={}:{}+rank", e.addr, e.base_port),
        }
    }
}

/// The running endpoint: one thread, stopped by [`shutdown`](Exporter::shutdown).
#[derive(Debug)]
pub(crate) struct Exporter {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    waker: Waker,
    thread: JoinHandle<()>,
}

const LISTENER: Token = Token(usize::MAX);
const WAKER: Token = Token(usize::MAX - 1);

impl Exporter {
    /// Binds `addr` (errors, e.g. the port in use, come back here, before any thread
    /// starts) and starts serving `handle`.
    pub(crate) fn start(addr: SocketAddr, handle: PrometheusHandle) -> io::Result<Exporter> {
        let mut listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        let stop = Arc::new(AtomicBool::new(false));
        let server = Server {
            poll,
            listener,
            conns: Slab::with_capacity(MAX_CONNECTIONS),
            handle,
            stop: stop.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("rlvr-metrics".into())
            .spawn(move || server.run())?;
        Ok(Exporter {
            addr,
            stop,
            waker,
            thread,
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Wakes the thread and joins it; the thread never blocks but in `poll`, so this
    /// returns at once whatever clients are connected.
    pub(crate) fn shutdown(self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Err(e) = self.waker.wake() {
            // Cannot happen with a live eventfd; the thread still sees `stop` at its next
            // upkeep tick, so the join below ends either way.
            tracing::warn!("railover: waking the metrics thread failed: {e}");
        }
        if self.thread.join().is_err() {
            tracing::warn!("railover: the metrics thread panicked");
        }
    }
}

struct Server {
    poll: Poll,
    listener: TcpListener,
    conns: Slab<Conn>,
    handle: PrometheusHandle,
    stop: Arc<AtomicBool>,
}

/// One client connection: reading its request head, then writing the answer.
struct Conn {
    stream: TcpStream,
    deadline: Instant,
    head: Vec<u8>,
    /// The whole answer, once the head is complete; `sent` bytes of it are written.
    out: Option<Vec<u8>>,
    sent: usize,
}

impl Server {
    fn run(mut self) {
        let mut events = Events::with_capacity(256);
        let mut last_upkeep = Instant::now();
        while !self.stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            let next = self
                .conns
                .iter()
                .map(|(_, c)| c.deadline)
                .min()
                .map_or(UPKEEP_EVERY, |d| d.saturating_duration_since(now))
                .min(UPKEEP_EVERY);
            if let Err(e) = self.poll.poll(&mut events, Some(next)) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::warn!("railover: metrics endpoint stopped: poll failed: {e}");
                return;
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept_all(),
                    WAKER => {}
                    Token(k) => self.serve(k),
                }
            }
            let now = Instant::now();
            self.conns.retain(|_, c| c.deadline > now);
            if now.saturating_duration_since(last_upkeep) >= UPKEEP_EVERY {
                self.handle.run_upkeep();
                last_upkeep = now;
            }
        }
    }

    /// The listener is edge-triggered: accept until it would block.
    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => self.add(stream),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // ECONNABORTED, EMFILE and the like: this connection is lost, the
                    // listener is not. A later readiness edge retries.
                    tracing::debug!("railover: metrics accept failed: {e}");
                    return;
                }
            }
        }
    }

    fn add(&mut self, mut stream: TcpStream) {
        if self.conns.len() >= MAX_CONNECTIONS {
            // Make room: the connection that has waited longest for its request goes
            // (answers being written are finished first).
            let victim = self
                .conns
                .iter()
                .min_by_key(|(_, c)| (c.out.is_some(), c.deadline))
                .map(|(k, _)| k);
            if let Some(k) = victim {
                self.conns.remove(k);
            }
        }
        let entry = self.conns.vacant_entry();
        let token = Token(entry.key());
        if let Err(e) = self.poll.registry().register(
            &mut stream,
            token,
            Interest::READABLE | Interest::WRITABLE,
        ) {
            tracing::debug!("railover: cannot watch a metrics connection: {e}");
            return;
        }
        entry.insert(Conn {
            stream,
            deadline: Instant::now() + CONNECTION_DEADLINE,
            head: Vec::new(),
            out: None,
            sent: 0,
        });
        // Data may have arrived before registration; edge-triggered readiness would not
        // report it again.
        self.serve(token.0);
    }

    /// Reads what connection `k` has, answers once its head is complete, writes what the
    /// socket takes; drops the connection when done or broken.
    fn serve(&mut self, k: usize) {
        let Some(c) = self.conns.get_mut(k) else {
            return;
        };
        let keep = match c.step(&self.handle) {
            Ok(keep) => keep,
            Err(e) => {
                tracing::debug!("railover: metrics request failed: {e}");
                false
            }
        };
        if !keep {
            self.conns.remove(k);
        }
    }
}

impl Conn {
    /// Advances the exchange as far as the socket allows; `Ok(false)` once it is over.
    fn step(&mut self, handle: &PrometheusHandle) -> io::Result<bool> {
        let mut buf = [0u8; 1024];
        while self.out.is_none() {
            match self.stream.read(&mut buf) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.head.extend_from_slice(&buf[..n]);
                    if head_complete(&self.head) {
                        self.out = Some(answer(&self.head, handle));
                    } else if self.head.len() > MAX_HEAD {
                        self.out = Some(response("431 Request Header Fields Too Large", "", false));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let out = self.out.as_deref().unwrap_or_default();
        while self.sent < out.len() {
            match self.stream.write(&out[self.sent..]) {
                Ok(0) => return Ok(false),
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        // All written: close our side (Connection: close).
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        Ok(false)
    }
}

/// The answer to one request head.
fn answer(head: &[u8], handle: &PrometheusHandle) -> Vec<u8> {
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_ascii_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let head_only = method == "HEAD";
    match (method, path) {
        ("GET" | "HEAD", "/metrics") => response("200 OK", &handle.render(), head_only),
        ("GET" | "HEAD", "/") => response("200 OK", "railover metrics: GET /metrics\n", head_only),
        ("GET" | "HEAD", _) => response("404 Not Found", "not found\n", head_only),
        _ => response("405 Method Not Allowed", "only GET and HEAD\n", false),
    }
}

/// A blank line ends the head; bare `\n` line ends are accepted too (RFC 9112 §2.2).
fn head_complete(head: &[u8]) -> bool {
    head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n")
}

fn response(status: &str, body: &str, head_only: bool) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if !head_only {
        out.push_str(body);
    }
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<ExporterConfig, ConfigError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ExporterConfig::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_bind_every_interface_at_9464_plus_ordinal() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c, ExporterConfig::default());
        assert_eq!(
            c.socket_addr(None).unwrap(),
            Some("0.0.0.0:9464".parse().unwrap())
        );
        assert_eq!(
            c.socket_addr(Some(3)).unwrap(),
            Some("0.0.0.0:9467".parse().unwrap())
        );
    }

    #[test]
    fn local_rank_wins_over_device_ordinal() {
        let c = cfg(&[
            ("RAILOVER_METRICS_PORT", "9000"),
            ("RAILOVER_METRICS_ADDR", "127.0.0.1"),
            ("LOCAL_RANK", "5"),
        ])
        .unwrap();
        assert_eq!(
            c.socket_addr(Some(1)).unwrap(),
            Some("127.0.0.1:9005".parse().unwrap())
        );
        let c = cfg(&[("SLURM_LOCALID", "2"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1")]).unwrap();
        assert_eq!(c.endpoint.unwrap().local_rank, Some(1));
        assert_eq!(c.local_rank, Some(1));
        // Known without an endpoint too: railover status shows it.
        let c = cfg(&[("RAILOVER_METRICS_PORT", "off"), ("LOCAL_RANK", "3")]).unwrap();
        assert_eq!((c.endpoint, c.local_rank), (None, Some(3)));
    }

    #[test]
    fn off_and_any_port() {
        for off in ["off", "OFF", "Off"] {
            let c = cfg(&[("RAILOVER_METRICS_PORT", off)]).unwrap();
            assert_eq!(c, ExporterConfig::off());
            assert_eq!(c.socket_addr(Some(1)).unwrap(), None);
        }
        let c = cfg(&[("RAILOVER_METRICS_PORT", "0"), ("LOCAL_RANK", "4")]).unwrap();
        assert_eq!(c.socket_addr(None).unwrap().unwrap().port(), 0);
        let c = cfg(&[("RAILOVER_METRICS_ADDR", "::1")]).unwrap();
        assert_eq!(
            c.socket_addr(None).unwrap(),
            Some("[::1]:9464".parse().unwrap())
        );
    }

    #[test]
    fn numbers_and_keywords_are_strict() {
        // Parsed as they are: no blanks around them, no sign, no trailing newline.
        for (var, value) in [
            ("RAILOVER_METRICS_PORT", " 9000"),
            ("RAILOVER_METRICS_PORT", "9000 "),
            ("RAILOVER_METRICS_PORT", "+9000"),
            ("RAILOVER_METRICS_PORT", "9000\n"),
            ("RAILOVER_METRICS_PORT", " off"),
            ("RAILOVER_METRICS_PORT", "off\n"),
            ("RAILOVER_METRICS_ADDR", " 127.0.0.1"),
            ("RAILOVER_METRICS_ADDR", "127.0.0.1\n"),
            ("LOCAL_RANK", " 1"),
            ("LOCAL_RANK", "+1"),
            ("LOCAL_RANK", "1\n"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "+1"),
            ("SLURM_LOCALID", "1 "),
        ] {
            let e = cfg(&[(var, value)]).unwrap_err();
            assert_eq!((e.var, e.value.as_str()), (var, value));
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("{var}={value:?}")) && msg.contains("expected"),
                "{msg}"
            );
        }
        let c = cfg(&[("RAILOVER_METRICS_PORT", "09000"), ("LOCAL_RANK", "1")]).unwrap();
        assert_eq!(c.socket_addr(None).unwrap().unwrap().port(), 9001);
    }

    #[test]
    fn bad_values_name_variable_value_and_accepted() {
        let e = cfg(&[("RAILOVER_METRICS_PORT", "nine")]).unwrap_err();
        assert_eq!(e.var, "RAILOVER_METRICS_PORT");
        assert_eq!(e.value, "nine");
        let msg = e.to_string();
        assert!(
            msg.contains("RAILOVER_METRICS_PORT=\"nine\"") && msg.contains("off"),
            "{msg}"
        );
        let e = cfg(&[("RAILOVER_METRICS_PORT", "70000")]).unwrap_err();
        assert_eq!(e.var, "RAILOVER_METRICS_PORT");
        let e = cfg(&[("RAILOVER_METRICS_ADDR", "localhost:1")]).unwrap_err();
        assert_eq!(
            (e.var, e.value.as_str()),
            ("RAILOVER_METRICS_ADDR", "localhost:1")
        );
        assert!(e.to_string().contains("IPv4 or IPv6"), "{e}");
        let e = cfg(&[("LOCAL_RANK", "-1")]).unwrap_err();
        assert_eq!((e.var, e.value.as_str()), ("LOCAL_RANK", "-1"));
        let e = cfg(&[("LOCAL_RANK", "65536")]).unwrap_err();
        assert!(e.to_string().contains("0 to 65535"), "{e}");
        let e = cfg(&[
            ("RAILOVER_METRICS_PORT", "off"),
            ("RAILOVER_METRICS_ADDR", "nowhere"),
        ])
        .unwrap_err();
        assert_eq!(e.var, "RAILOVER_METRICS_ADDR", "checked even when off");
        let e = cfg(&[("RAILOVER_METRICS_PORT", "65535"), ("LOCAL_RANK", "1")]).unwrap_err();
        assert_eq!(
            (e.var, e.value.as_str()),
            ("RAILOVER_METRICS_PORT", "65535")
        );
    }

    use std::net::TcpStream;

    /// Sends `request` raw and returns the whole answer.
    fn exchange(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    fn local_exporter() -> Exporter {
        // A recorder of its own, not the global one: only the HTTP side is under test.
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::Recorder::register_counter(
            &recorder,
            &metrics::Key::from_static_name("railover_unit_total"),
            &metrics::Metadata::new("t", metrics::Level::INFO, None),
        )
        .increment(5);
        Exporter::start("127.0.0.1:0".parse().unwrap(), handle).unwrap()
    }

    #[test]
    fn answers_get_head_and_refuses_the_rest() {
        let e = local_exporter();
        let addr = e.local_addr();
        let get = exchange(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(get.starts_with("HTTP/1.1 200 OK\r\n"), "{get}");
        assert!(
            get.contains("Content-Type: text/plain; version=0.0.4"),
            "{get}"
        );
        assert!(get.contains("\nrailover_unit_total 5\n"), "{get}");
        let bare_lf = exchange(addr, "GET /metrics HTTP/1.0\n\n");
        assert!(bare_lf.contains("railover_unit_total 5"), "{bare_lf}");
        let head = exchange(addr, "HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(
            head.starts_with("HTTP/1.1 200 OK") && head.ends_with("\r\n\r\n"),
            "{head}"
        );
        let post = exchange(addr, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        let other = exchange(addr, "GET /debug HTTP/1.1\r\n\r\n");
        assert!(other.starts_with("HTTP/1.1 404"), "{other}");
        e.shutdown();
    }

    #[test]
    fn shutdown_joins_even_with_silent_clients_connected() {
        let e = local_exporter();
        let addr = e.local_addr();
        let _silent = TcpStream::connect(addr).unwrap();
        let mut half = TcpStream::connect(addr).unwrap();
        half.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
        // The thread never blocks on a client, so the join ends; a hang here is the
        // failure. (The port is not probed afterwards: a parallel test may get it.)
        e.shutdown();
    }

    #[test]
    fn more_idle_clients_than_the_limit_do_not_keep_a_scrape_out() {
        let e = local_exporter();
        let addr = e.local_addr();
        let idle: Vec<TcpStream> = (0..MAX_CONNECTIONS * 3)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        // Concurrent, too: a request whose head arrives in pieces holds nothing up.
        let mut slow = TcpStream::connect(addr).unwrap();
        slow.write_all(b"GET /metr").unwrap();
        let get = exchange(addr, "GET /metrics HTTP/1.1\r\n\r\n");
        assert!(get.contains("railover_unit_total 5"), "{get}");
        drop(idle);
        e.shutdown();
    }

    #[test]
    fn ordinal_past_the_port_range_is_refused_not_wrapped() {
        let c = cfg(&[("RAILOVER_METRICS_PORT", "65535")]).unwrap();
        assert!(c.socket_addr(Some(1)).is_err());
        assert!(c.socket_addr(None).unwrap().is_some());
    }
}
