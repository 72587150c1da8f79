//! `fusex top`: a live view of a daemon's exports, one line each, from two samples of
//! `__org.fusex_query-stats` an interval apart: IOPS and MB/s from the counters' growth over the
//! real time between the samples, latency percentiles from the growth of each bucket of the
//! histograms (what happened in the interval, not since the export started), the requests in
//! flight now and the errors of the interval. `--once` prints one such table, or JSON, for
//! scripts.
//!
//! The screen is drawn with a handful of ANSI sequences (cursor home, clear to end of line and
//! of screen, the alternate screen) on a terminal put in non-canonical mode with termios, and
//! everything it changed is put back on every way out: `q`, Ctrl-C, SIGINT, SIGTERM, SIGHUP, an
//! error (a lost daemon) or a panic.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use export::Latency;
use serde_json::{json, Value};

use crate::cli::TopArgs;
use crate::qmp_client::{default_socket, Client};

/// The QMP command that reports every export's statistics.
const QUERY_STATS: &str = "__org.fusex_query-stats";

/// The opcodes that move or settle data: the ones IOPS counts and whose latency the percentiles
/// describe (a file's lookups and attribute reads are not what a disk image's user waits on).
const DATA_OPS: &[&str] = &[
    "READ",
    "WRITE",
    "FSYNC",
    "FLUSH",
    "FALLOCATE",
    "COPY_FILE_RANGE",
    "COPY_FILE_RANGE_64",
];

/// Columns after the ID: title and width, right-aligned, one space before each.
const COLUMNS: [(&str, usize); 8] = [
    ("IOPS", 7),
    ("R MB/s", 7),
    ("W MB/s", 7),
    ("p50", 7),
    ("p99", 7),
    ("p99.9", 7),
    ("INFL", 5),
    ("ERR", 5),
];

/// How long a reply may take before the daemon counts as lost.
const STATS_TIMEOUT: Duration = Duration::from_secs(10);

/// The order of the lines.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortKey {
    /// Busiest first (requests per second).
    Iops,
    /// Most read first (MB/s).
    Read,
    /// Most written first (MB/s).
    Write,
    /// Slowest first (99th percentile).
    P99,
    /// Most errors in the interval first.
    Errors,
    /// By export id.
    Id,
}

impl SortKey {
    const ALL: [SortKey; 6] = [
        SortKey::Iops,
        SortKey::Read,
        SortKey::Write,
        SortKey::P99,
        SortKey::Errors,
        SortKey::Id,
    ];

    fn name(self) -> &'static str {
        match self {
            SortKey::Iops => "iops",
            SortKey::Read => "read",
            SortKey::Write => "write",
            SortKey::P99 => "p99",
            SortKey::Errors => "errors",
            SortKey::Id => "id",
        }
    }

    /// The order a key pressed while running asks for: `s` the next one, or a letter of its own.
    fn after_key(self, key: u8) -> Option<SortKey> {
        Some(match key {
            b's' => {
                let i = Self::ALL.iter().position(|k| *k == self).unwrap_or(0);
                Self::ALL[(i + 1) % Self::ALL.len()]
            }
            b'i' => SortKey::Iops,
            b'r' => SortKey::Read,
            b'w' => SortKey::Write,
            b'p' => SortKey::P99,
            b'e' => SortKey::Errors,
            b'n' => SortKey::Id,
            _ => return None,
        })
    }
}

/// `--interval`: seconds, fractions allowed, from 0.1 to an hour.
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of seconds"))?;
    if !(0.1..=3600.0).contains(&secs) {
        return Err(format!("{s} is not between 0.1 and 3600 seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// What `top` reads of one export's statistics at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
struct Sample {
    id: String,
    uptime_ns: u64,
    requests: u64,
    read_ops: u64,
    write_ops: u64,
    data_ops: u64,
    bytes_read: u64,
    bytes_written: u64,
    in_flight: u64,
    errors: u64,
    /// The data opcodes' arrival-to-reply histograms merged.
    latency: Latency,
}

impl Sample {
    /// One entry of `__org.fusex_query-stats`'s `exports`; None without an id.
    fn from_json(v: &Value) -> Option<Sample> {
        let n = |v: &Value| v.as_u64().unwrap_or(0);
        let op = |name: &str| n(&v["ops"][name]);
        let mut latency = Latency::default();
        for name in DATA_OPS {
            if let Some(l) = v["latency"].get(*name).and_then(Latency::from_json) {
                latency.merge(&l);
            }
        }
        Some(Sample {
            id: v.get("id")?.as_str()?.to_string(),
            uptime_ns: n(&v["uptime_ns"]),
            requests: n(&v["requests"]),
            read_ops: op("READ"),
            write_ops: op("WRITE"),
            data_ops: DATA_OPS.iter().map(|o| op(o)).sum(),
            bytes_read: n(&v["backend"]["bytes_read"]),
            bytes_written: n(&v["backend"]["bytes_written"]),
            in_flight: n(&v["in_flight"]),
            errors: v["errors"]
                .as_array()
                .map(|l| l.iter().map(|e| n(&e["count"])).sum())
                .unwrap_or(0),
            latency,
        })
    }
}

/// One export over an interval.
#[derive(Clone, Debug, PartialEq)]
struct Row {
    id: String,
    /// Data requests (reads, writes, flushes, ...) per second.
    iops: f64,
    read_iops: f64,
    write_iops: f64,
    /// Megabytes (10⁶ bytes) per second the backend read and wrote.
    read_mbps: f64,
    write_mbps: f64,
    p50_ns: Option<u64>,
    p99_ns: Option<u64>,
    p999_ns: Option<u64>,
    in_flight: u64,
    /// Error replies in the interval, and since the export started.
    errors: u64,
    errors_total: u64,
    /// Requests of any kind in the interval, and since the export started.
    requests: u64,
    requests_total: u64,
}

/// An export's figures between `prev` and `cur`, `elapsed` apart. An export without an earlier
/// sample (new, or removed and added again: its uptime went back) counts from its start.
fn interval(prev: Option<&Sample>, cur: &Sample, elapsed: Duration) -> Row {
    let zero = Sample::default();
    let (base, secs) = match prev {
        Some(p) if p.uptime_ns <= cur.uptime_ns => (p, elapsed.as_secs_f64()),
        _ => (
            &zero,
            elapsed
                .as_secs_f64()
                .min(cur.uptime_ns as f64 / 1e9)
                .max(1e-3),
        ),
    };
    let secs = secs.max(1e-6);
    let rate = |now: u64, then: u64| now.saturating_sub(then) as f64 / secs;
    let lat = cur.latency.since(&base.latency);
    Row {
        id: cur.id.clone(),
        iops: rate(cur.data_ops, base.data_ops),
        read_iops: rate(cur.read_ops, base.read_ops),
        write_iops: rate(cur.write_ops, base.write_ops),
        read_mbps: rate(cur.bytes_read, base.bytes_read) / 1e6,
        write_mbps: rate(cur.bytes_written, base.bytes_written) / 1e6,
        p50_ns: lat.percentile_ns(0.5),
        p99_ns: lat.percentile_ns(0.99),
        p999_ns: lat.percentile_ns(0.999),
        in_flight: cur.in_flight,
        errors: cur.errors.saturating_sub(base.errors),
        errors_total: cur.errors,
        requests: cur.requests.saturating_sub(base.requests),
        requests_total: cur.requests,
    }
}

/// Every export of `cur`, against its sample in `prev`.
fn rows(prev: &[Sample], cur: &[Sample], elapsed: Duration) -> Vec<Row> {
    let earlier: BTreeMap<&str, &Sample> = prev.iter().map(|s| (s.id.as_str(), s)).collect();
    cur.iter()
        .map(|s| interval(earlier.get(s.id.as_str()).copied(), s, elapsed))
        .collect()
}

/// Sorts biggest first (the id column: alphabetically); ties by id.
fn sort_rows(rows: &mut [Row], key: SortKey) {
    let value = |r: &Row| -> f64 {
        match key {
            SortKey::Iops => r.iops,
            SortKey::Read => r.read_mbps,
            SortKey::Write => r.write_mbps,
            SortKey::P99 => r.p99_ns.map_or(-1.0, |n| n as f64),
            SortKey::Errors => r.errors as f64,
            SortKey::Id => 0.0,
        }
    };
    rows.sort_by(|a, b| value(b).total_cmp(&value(a)).then_with(|| a.id.cmp(&b.id)));
}

/// A rate in at most 7 columns: decimals while small, k and M when large.
fn fmt_rate(x: f64) -> String {
    if x <= 0.0 {
        "0".into()
    } else if x < 10.0 {
        format!("{x:.1}")
    } else if x < 999_999.5 {
        format!("{x:.0}")
    } else if x < 999_999_500.0 {
        format!("{:.1}M", x / 1e6)
    } else {
        format!("{:.0}G", (x / 1e9).min(99_999.0))
    }
}

/// Megabytes per second in at most 7 columns.
fn fmt_mbps(x: f64) -> String {
    if x <= 0.0 {
        "0".into()
    } else if x < 10.0 {
        format!("{x:.2}")
    } else if x < 1000.0 {
        format!("{x:.1}")
    } else {
        fmt_rate(x)
    }
}

/// A latency in µs, ms or s, three significant digits at most; `-` when nothing was timed.
fn fmt_latency(ns: Option<u64>) -> String {
    let Some(ns) = ns else {
        return "-".into();
    };
    let ns = ns as f64;
    let (v, unit) = if ns < 999_500.0 {
        (ns / 1e3, "µs")
    } else if ns < 999_500_000.0 {
        (ns / 1e6, "ms")
    } else {
        // The slowest bucket starts at 134 s; anything beyond is shown as a bound.
        ((ns / 1e9).min(99_999.0), "s")
    };
    if v < 9.995 {
        format!("{v:.2}{unit}")
    } else if v < 99.95 {
        format!("{v:.1}{unit}")
    } else {
        format!("{v:.0}{unit}")
    }
}

/// A count in at most 5 columns.
fn fmt_count(n: u64) -> String {
    if n < 100_000 {
        n.to_string()
    } else if n < 10_000_000 {
        format!("{}k", n / 1000)
    } else {
        format!("{}M", (n / 1_000_000).min(9999))
    }
}

/// `s` cut to `width` columns (one per character), its last one an ellipsis when cut.
fn fit(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        return s.to_string();
    }
    if width == 0 {
        return String::new();
    }
    let mut out: String = s.chars().take(width - 1).collect();
    out.push('…');
    out
}

/// Characters (terminal columns) right-aligned in `width`.
fn right(s: &str, width: usize) -> String {
    let pad = width.saturating_sub(s.chars().count());
    format!("{}{s}", " ".repeat(pad))
}

/// The column titles and one line per row, none wider than `width`.
fn table(rows: &[Row], width: usize) -> Vec<String> {
    let fixed: usize = COLUMNS.iter().map(|(_, w)| w + 1).sum();
    let longest = rows.iter().map(|r| r.id.chars().count()).max().unwrap_or(0);
    let id_width = longest.max(2).min(width.saturating_sub(fixed).max(4));
    let line = |id: &str, cells: [String; 8]| {
        let mut l = format!("{:id_width$}", fit(id, id_width));
        // {:w$} pads by characters, which is what the cells' µ needs too.
        for (c, (_, w)) in cells.iter().zip(COLUMNS.iter()) {
            l.push(' ');
            l.push_str(&right(c, *w));
        }
        fit(l.trim_end(), width)
    };
    let mut out = vec![line("ID", COLUMNS.map(|(t, _)| t.to_string()))];
    for r in rows {
        out.push(line(
            &r.id,
            [
                fmt_rate(r.iops),
                fmt_mbps(r.read_mbps),
                fmt_mbps(r.write_mbps),
                fmt_latency(r.p50_ns),
                fmt_latency(r.p99_ns),
                fmt_latency(r.p999_ns),
                fmt_count(r.in_flight),
                fmt_count(r.errors),
            ],
        ));
    }
    out
}

/// `--once --json`'s document.
fn to_json(rows: &[Row], elapsed: Duration) -> Value {
    let us = |ns: Option<u64>| ns.map(|n| n as f64 / 1e3);
    let exports: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "id": r.id,
                "iops": r.iops,
                "read_iops": r.read_iops,
                "write_iops": r.write_iops,
                "read_mbps": r.read_mbps,
                "write_mbps": r.write_mbps,
                "p50_us": us(r.p50_ns),
                "p99_us": us(r.p99_ns),
                "p999_us": us(r.p999_ns),
                "in_flight": r.in_flight,
                "errors": r.errors,
                "errors_total": r.errors_total,
                "requests": r.requests,
                "requests_total": r.requests_total,
            })
        })
        .collect();
    json!({"interval_s": elapsed.as_secs_f64(), "exports": exports})
}

/// Reads every export's statistics; the samples and when they were taken (halfway through the
/// round trip).
fn sample(c: &mut Client) -> Result<(Vec<Sample>, Instant)> {
    let sent = Instant::now();
    let r = c.execute(QUERY_STATS, json!({}))?;
    let at = sent + sent.elapsed() / 2;
    // Events (an export removed) are not shown; do not keep them.
    c.events.clear();
    let list = r["exports"]
        .as_array()
        .ok_or_else(|| anyhow!("{QUERY_STATS} returned no exports list"))?;
    Ok((list.iter().filter_map(Sample::from_json).collect(), at))
}

/// Runs `fusex top`.
pub fn run(args: TopArgs) -> Result<()> {
    let path = args.control.clone().unwrap_or_else(default_socket);
    let mut c = Client::connect(&path)?;
    c.set_reply_timeout(STATS_TIMEOUT + args.interval)?;
    let lost = |e: anyhow::Error| e.context(format!("lost the daemon at {}", path.display()));
    let (first, t0) = sample(&mut c).with_context(|| {
        format!(
            "{} does not report statistics ({QUERY_STATS})",
            path.display()
        )
    })?;
    if args.once {
        std::thread::sleep(args.interval.saturating_sub(t0.elapsed()));
        let (cur, t1) = sample(&mut c).map_err(lost)?;
        let elapsed = t1 - t0;
        let mut r = rows(&first, &cur, elapsed);
        sort_rows(&mut r, args.sort);
        if args.json {
            println!("{}", serde_json::to_string_pretty(&to_json(&r, elapsed))?);
        } else {
            let width = terminal_size().map_or(80, |(w, _)| w);
            println!("{}", table(&r, width).join("\n"));
        }
        return Ok(());
    }
    live(&mut c, &args, &path, first, t0).map_err(lost)
}

/// The live view, until `q`, Ctrl-C or a signal; on a terminal, or a table per interval when
/// standard output is not one.
fn live(
    c: &mut Client,
    args: &TopArgs,
    path: &Path,
    mut prev: Vec<Sample>,
    mut t0: Instant,
) -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    let resized = Arc::new(AtomicBool::new(false));
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    signal_hook::flag::register(libc::SIGWINCH, resized.clone())?;
    let mut term = if std::io::stdout().is_terminal() {
        Some(Terminal::enter()?)
    } else {
        None
    };
    let mut sort = args.sort;
    let mut shown: Option<Vec<Row>> = None;
    let mut redraw = true;
    loop {
        if redraw {
            if let Some(t) = term.as_mut() {
                let (w, h) = terminal_size().unwrap_or((80, 24));
                let lines = screen(path, sort, shown.as_deref(), w, h);
                t.draw(&lines, w, h)?;
            } else if let Some(r) = &shown {
                let mut out = std::io::stdout().lock();
                writeln!(out, "{}\n", table(r, 80).join("\n"))?;
                out.flush()?;
            }
            redraw = false;
        }
        let deadline = t0 + args.interval;
        while Instant::now() < deadline {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            if resized.swap(false, Ordering::Relaxed) {
                redraw = true;
                break;
            }
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(200));
            let Some(t) = term.as_mut() else {
                std::thread::sleep(wait);
                continue;
            };
            match t.key(wait)? {
                // q, Ctrl-C, Ctrl-\ (the terminal sends them as keys here) and end of input.
                Some(b'q' | b'Q' | 0x03 | 0x1c | 0x04) => return Ok(()),
                Some(k) => {
                    if let Some(s) = sort.after_key(k) {
                        sort = s;
                        if let Some(r) = shown.as_mut() {
                            sort_rows(r, sort);
                        }
                        redraw = true;
                        break;
                    }
                }
                None => {}
            }
        }
        if redraw {
            continue;
        }
        let (cur, t1) = sample(c)?;
        let mut r = rows(&prev, &cur, t1 - t0);
        sort_rows(&mut r, sort);
        shown = Some(r);
        (prev, t0) = (cur, t1);
        redraw = true;
    }
}

/// The whole screen: a header line, the column titles, as many exports as fit.
fn screen(
    path: &Path,
    sort: SortKey,
    rows: Option<&[Row]>,
    width: usize,
    height: usize,
) -> Vec<String> {
    let count = rows.map_or(String::new(), |r| {
        format!(
            "  {} export{}",
            r.len(),
            if r.len() == 1 { "" } else { "s" }
        )
    });
    let rest = format!(
        "  {}{count}  sort {}  q quits, s sorts",
        clock(),
        sort.name()
    );
    // The socket's path loses its start first: its end names it.
    let daemon = path.display().to_string();
    let room = width.saturating_sub(rest.chars().count()).max(12);
    let daemon = if daemon.chars().count() > room {
        let n = daemon.chars().count();
        format!("…{}", daemon.chars().skip(n - room + 1).collect::<String>())
    } else {
        daemon
    };
    let mut out = vec![fit(&format!("{daemon}{rest}"), width)];
    let Some(rows) = rows else {
        out.push(fit("(first interval: sampling)", width));
        return out;
    };
    let mut t = table(rows, width);
    let room = height.saturating_sub(1).max(2);
    if t.len() > room {
        let hidden = t.len() - (room - 1);
        t.truncate(room - 1);
        t.push(fit(&format!("… {hidden} more"), width));
    }
    out.extend(t);
    out
}

/// The local time of day, HH:MM:SS.
fn clock() -> String {
    // SAFETY: time accepts a null pointer; localtime_r writes only into `tm`, which it fully
    // initializes on success (checked).
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return String::new();
        }
        format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec)
    }
}

/// Standard output's terminal size (columns, rows), if it is a terminal that knows it.
fn terminal_size() -> Option<(usize, usize)> {
    // SAFETY: TIOCGWINSZ writes one winsize into `ws`; a zeroed winsize is a valid value.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: stdout's descriptor stays open for the call; `ws` is a valid winsize.
    let r = unsafe { libc::ioctl(std::io::stdout().as_raw_fd(), libc::TIOCGWINSZ, &mut ws) };
    (r == 0 && ws.ws_col > 0).then(|| (usize::from(ws.ws_col), usize::from(ws.ws_row.max(1))))
}

/// The terminal in top's mode: keys one at a time without echo, the alternate screen, no
/// cursor. Dropping it puts everything back.
struct Terminal {
    /// Standard input's settings before, when it is a terminal (keys are read from it).
    saved: Option<libc::termios>,
}

impl Terminal {
    fn enter() -> Result<Terminal> {
        let stdin = std::io::stdin().as_raw_fd();
        let mut saved = None;
        if std::io::stdin().is_terminal() {
            // SAFETY: a zeroed termios is a valid value for tcgetattr to overwrite.
            let mut t: libc::termios = unsafe { std::mem::zeroed() };
            // SAFETY: stdin is open; `t` is a valid termios.
            if unsafe { libc::tcgetattr(stdin, &mut t) } != 0 {
                return Err(std::io::Error::last_os_error()).context("reading the terminal mode");
            }
            let mut raw = t;
            // Keys as they are pressed, not echoed; Ctrl-C and Ctrl-Z arrive as keys (0x03 quits,
            // so nothing stops with the terminal still in this mode). Output processing stays.
            raw.c_lflag &= !(libc::ICANON | libc::ECHO | libc::ISIG | libc::IEXTEN);
            raw.c_cc[libc::VMIN] = 0;
            raw.c_cc[libc::VTIME] = 0;
            // SAFETY: stdin is open; `raw` is a valid termios.
            if unsafe { libc::tcsetattr(stdin, libc::TCSANOW, &raw) } != 0 {
                return Err(std::io::Error::last_os_error()).context("setting the terminal mode");
            }
            saved = Some(t);
        }
        let term = Terminal { saved };
        // Alternate screen, cursor hidden.
        let mut out = std::io::stdout().lock();
        out.write_all(b"\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J")?;
        out.flush()?;
        Ok(term)
    }

    /// Draws `lines` from the top left over a `width`×`height` screen, each line cleared to
    /// its end and the rest of the screen cleared. A line that fills the width leaves the cursor
    /// on its last column with the wrap pending, where clearing would erase that column: such a
    /// line is not cleared after (it has nothing left to clear), and there is no newline after
    /// the last line of a full screen (it would scroll).
    fn draw(&mut self, lines: &[String], width: usize, height: usize) -> Result<()> {
        let lines = &lines[..lines.len().min(height)];
        let mut s = String::from("\x1b[H");
        for (i, l) in lines.iter().enumerate() {
            if i > 0 {
                s.push_str("\r\n");
            }
            s.push_str(l);
            if l.chars().count() < width {
                s.push_str("\x1b[K");
            }
        }
        if lines.len() < height {
            s.push_str("\r\n\x1b[J");
        }
        let mut out = std::io::stdout().lock();
        out.write_all(s.as_bytes())?;
        out.flush()?;
        Ok(())
    }

    /// The next key pressed within `wait`; Some(4) (Ctrl-D) at the end of input.
    fn key(&mut self, wait: Duration) -> Result<Option<u8>> {
        if self.saved.is_none() {
            std::thread::sleep(wait);
            return Ok(None);
        }
        let mut pfd = libc::pollfd {
            fd: std::io::stdin().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(wait.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n <= 0 {
            // Timeout, or a signal (EINTR): the caller looks at its flags.
            return Ok(None);
        }
        let mut b = [0u8; 1];
        // SAFETY: reads at most one byte into `b`. Not through std's Stdin, whose buffer would
        // hide keys already read from poll.
        let r = unsafe { libc::read(pfd.fd, b.as_mut_ptr().cast(), 1) };
        match r {
            1 => Ok(Some(b[0])),
            0 => Ok(Some(0x04)),
            _ => Ok(None),
        }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        // Cursor shown, main screen back.
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(b"\x1b[?25h\x1b[?1049l");
        let _ = out.flush();
        if let Some(t) = &self.saved {
            // SAFETY: stdin is open; `t` is the termios read from it.
            unsafe { libc::tcsetattr(std::io::stdin().as_raw_fd(), libc::TCSANOW, t) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use export::latency::bucket_of;

    fn lat(values_ns: &[(u64, u64)]) -> Value {
        let mut l = Latency::default();
        for (ns, n) in values_ns {
            l.buckets[bucket_of(*ns)] += n;
            l.sum_ns += ns * n;
        }
        l.to_json()
    }

    fn export_json(id: &str, uptime_s: u64, reads: u64, writes: u64, lat_read: Value) -> Value {
        json!({
            "id": id, "node": id, "mountpoint": "/m", "uptime_ns": uptime_s * 1_000_000_000,
            "requests": reads + writes + 3, "malformed": 0,
            "ops": {"READ": reads, "WRITE": writes, "GETATTR": 3},
            "backend": {"reads": reads, "writes": writes, "flushes": 0,
                        "bytes_read": reads * 4096, "bytes_written": writes * 4096},
            "in_flight": 2, "entries": 1,
            "errors": [{"op": "READ", "errno": 5, "name": "EIO", "count": writes / 100}],
            "latency": {"READ": lat_read, "GETATTR": lat(&[(5_000_000_000, 3)])},
            "backend_latency": {}, "queues": []
        })
    }

    fn row(id: &str, iops: f64, p99: Option<u64>, errors: u64) -> Row {
        Row {
            id: id.into(),
            iops,
            read_iops: iops,
            write_iops: 0.0,
            read_mbps: iops * 4096.0 / 1e6,
            write_mbps: 1.0 / (iops + 1.0),
            p50_ns: p99,
            p99_ns: p99,
            p999_ns: p99,
            in_flight: 0,
            errors,
            errors_total: errors,
            requests: iops as u64,
            requests_total: iops as u64,
        }
    }

    #[test]
    fn intervals_are_deltas_over_the_real_time_between_samples() {
        let a =
            Sample::from_json(&export_json("a", 10, 1000, 500, lat(&[(10_000, 1000)]))).unwrap();
        // 2 s later: 400 more reads, 200 of them slow (5 ms); 100 more writes.
        let b = Sample::from_json(&export_json(
            "a",
            12,
            1400,
            600,
            lat(&[(10_000, 1200), (5_000_000, 200)]),
        ))
        .unwrap();
        let r = interval(Some(&a), &b, Duration::from_secs(2));
        assert_eq!(r.read_iops, 200.0);
        assert_eq!(r.write_iops, 50.0);
        assert_eq!(r.iops, 250.0);
        assert_eq!(r.read_mbps, 400.0 * 4096.0 / 2.0 / 1e6);
        assert_eq!(r.write_mbps, 100.0 * 4096.0 / 2.0 / 1e6);
        assert_eq!(r.requests, 500);
        assert_eq!(r.requests_total, 2003);
        assert_eq!(r.errors, 1);
        assert_eq!(r.errors_total, 6);
        assert_eq!(r.in_flight, 2);
        // Half of the interval's reads were slow: the median is at the boundary of the fast
        // bucket, p99 in the slow one. Since start, the slow ones are 200 of 1400 (p50 fast).
        let fast = export::latency::bucket_upper_ns(bucket_of(10_000));
        let slow = export::latency::bucket_upper_ns(bucket_of(5_000_000));
        assert_eq!(r.p50_ns, Some(fast));
        assert_eq!(r.p99_ns, Some(slow));
        assert_eq!(r.p999_ns, Some(slow));
        // GETATTR's 5 s are not data requests: not in the percentiles.
        let since_start = interval(None, &b, Duration::from_secs(2));
        assert_eq!(since_start.p50_ns, Some(fast));
        // No requests in the interval: no percentiles, zero rates.
        let idle = interval(Some(&b), &b, Duration::from_secs(1));
        assert_eq!((idle.iops, idle.p99_ns, idle.errors), (0.0, None, 0));
    }

    #[test]
    fn a_new_or_re_added_export_counts_from_its_start() {
        let old = Sample::from_json(&export_json("a", 100, 9000, 0, lat(&[]))).unwrap();
        // Added again 0.5 s ago with 100 reads: over its half second, not the 2 s interval.
        let new = Sample::from_json(&export_json("a", 0, 100, 0, lat(&[]))).unwrap();
        let new = Sample {
            uptime_ns: 500_000_000,
            ..new
        };
        let r = interval(Some(&old), &new, Duration::from_secs(2));
        assert_eq!(r.read_iops, 200.0);
        let set = rows(&[], std::slice::from_ref(&new), Duration::from_secs(2));
        assert_eq!(set[0].read_iops, 200.0);
    }

    #[test]
    fn exports_without_id_are_skipped_and_missing_fields_are_zero() {
        assert_eq!(Sample::from_json(&json!({"requests": 1})), None);
        let s = Sample::from_json(&json!({"id": "x"})).unwrap();
        assert_eq!(s.requests, 0);
        assert_eq!(s.latency.count(), 0);
    }

    #[test]
    fn units() {
        assert_eq!(fmt_latency(None), "-");
        assert_eq!(fmt_latency(Some(1_000)), "1.00µs");
        assert_eq!(fmt_latency(Some(11_250)), "11.2µs");
        assert_eq!(fmt_latency(Some(640_000)), "640µs");
        assert_eq!(fmt_latency(Some(999_999)), "1.00ms");
        assert_eq!(fmt_latency(Some(2_500_000)), "2.50ms");
        assert_eq!(fmt_latency(Some(134_000_000)), "134ms");
        assert_eq!(fmt_latency(Some(134_217_728_000)), "134s");
        assert_eq!(fmt_rate(0.0), "0");
        assert_eq!(fmt_rate(0.5), "0.5");
        assert_eq!(fmt_rate(12_345.4), "12345");
        assert_eq!(fmt_rate(999_999.4), "999999");
        assert_eq!(fmt_rate(2_500_000.0), "2.5M");
        assert_eq!(fmt_mbps(1.234), "1.23");
        assert_eq!(fmt_mbps(123.45), "123.5");
        assert_eq!(fmt_mbps(4321.0), "4321");
        assert_eq!(fmt_count(99_999), "99999");
        assert_eq!(fmt_count(123_456), "123k");
        assert_eq!(fmt_count(u64::MAX), "9999M");
        for s in [
            fmt_rate(f64::MAX),
            fmt_mbps(1e12),
            fmt_latency(Some(u64::MAX)),
        ] {
            assert!(s.chars().count() <= 7, "{s}");
        }
    }

    #[test]
    fn lines_fit_80_columns_and_long_ids_are_cut() {
        let long = "an-export-with-a-very-long-name-indeed-far-too-long";
        let mut r = row(long, 123_456.0, Some(u64::MAX), u64::MAX);
        r.in_flight = u64::MAX;
        r.write_mbps = 1e300;
        let t = table(&[r, row("b", 1.0, None, 0)], 80);
        assert_eq!(t.len(), 3);
        for l in &t {
            assert!(
                l.chars().count() <= 80,
                "{} columns: {l}",
                l.chars().count()
            );
        }
        assert!(t[0].starts_with("ID "));
        assert!(t[0].ends_with("ERR"));
        assert!(t[1].starts_with("an-export-with-a-"), "{}", t[1]);
        assert!(t[1].contains('…'));
        assert!(!t[1].contains(long));
        // Columns line up: every line ends at the same column (the right-aligned ERR).
        assert_eq!(t[0].chars().count(), t[1].chars().count());
        assert_eq!(t[0].chars().count(), t[2].chars().count());
        assert!(t[2].starts_with("b "));
        // Short ids keep the table narrow.
        let narrow = table(&[row("b", 1.0, None, 0)], 80);
        assert!(narrow[0].chars().count() < 70);
        // A narrower terminal cuts the lines.
        for l in table(&[row(long, 1.0, None, 0)], 40) {
            assert!(l.chars().count() <= 40, "{l}");
        }
    }

    #[test]
    fn the_screen_never_passes_the_terminal() {
        let rows: Vec<Row> = (0..50)
            .map(|i| row(&format!("e{i}"), i as f64, None, 0))
            .collect();
        let path =
            Path::new("/run/a/very/long/directory/name/to/make/the/header/long/control.sock");
        for (w, h) in [(80, 24), (40, 10), (200, 5)] {
            let s = screen(path, SortKey::Iops, Some(&rows), w, h);
            assert!(s.len() <= h, "{} lines on {h}", s.len());
            assert!(s.iter().all(|l| l.chars().count() <= w), "{s:?}");
            assert!(s.last().unwrap().contains("more"), "{s:?}");
        }
        let s = screen(path, SortKey::Id, Some(&rows[..2]), 80, 24);
        assert_eq!(s.len(), 4);
        assert!(s[0].contains("control.sock"), "{}", s[0]);
        assert!(s[0].contains("2 exports"), "{}", s[0]);
        assert!(s[0].contains("sort id"), "{}", s[0]);
        let first = screen(path, SortKey::Iops, None, 80, 24);
        assert_eq!(first.len(), 2);
    }

    #[test]
    fn sorting() {
        let mut r = vec![
            row("b", 10.0, Some(5), 1),
            row("a", 10.0, Some(50), 0),
            row("c", 99.0, None, 7),
        ];
        let ids = |r: &[Row]| r.iter().map(|x| x.id.clone()).collect::<Vec<_>>().join("");
        sort_rows(&mut r, SortKey::Iops);
        assert_eq!(ids(&r), "cab");
        sort_rows(&mut r, SortKey::Id);
        assert_eq!(ids(&r), "abc");
        sort_rows(&mut r, SortKey::P99);
        assert_eq!(ids(&r), "abc");
        sort_rows(&mut r, SortKey::Errors);
        assert_eq!(ids(&r), "cba");
        sort_rows(&mut r, SortKey::Read);
        assert_eq!(ids(&r), "cab");
        sort_rows(&mut r, SortKey::Write);
        assert_eq!(ids(&r), "abc");
        // s cycles through every order and back.
        let mut k = SortKey::Iops;
        for _ in 0..SortKey::ALL.len() {
            k = k.after_key(b's').unwrap();
        }
        assert_eq!(k, SortKey::Iops);
        assert_eq!(k.after_key(b'p'), Some(SortKey::P99));
        assert_eq!(k.after_key(b'x'), None);
    }

    #[test]
    fn json_document() {
        let v = to_json(&[row("a", 2.0, Some(1500), 1)], Duration::from_millis(1500));
        assert_eq!(v["interval_s"], 1.5);
        let e = &v["exports"][0];
        assert_eq!(e["id"], "a");
        assert_eq!(e["iops"], 2.0);
        assert_eq!(e["p99_us"], 1.5);
        assert_eq!(e["errors"], 1);
        let none = to_json(&[row("a", 2.0, None, 1)], Duration::from_secs(1));
        assert!(none["exports"][0]["p50_us"].is_null());
    }

    #[test]
    fn intervals() {
        assert_eq!(parse_interval("1"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_interval("0.5"), Ok(Duration::from_millis(500)));
        assert!(parse_interval("0").is_err());
        assert!(parse_interval("-1").is_err());
        assert!(parse_interval("nan").is_err());
        assert!(parse_interval("x").is_err());
    }
}
