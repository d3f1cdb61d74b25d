//! The standard `process_*` metrics of Prometheus' clients, read from `/proc` at each
//! scrape: CPU time, open and allowed file descriptors, memory, start time, threads.
//!
//! Not the `prometheus` crate's own collector: it counts CPU time in whole seconds (an
//! idle proxy's `rate(process_cpu_seconds_total[5m])` read 0, then a step of a whole
//! second) and truncates the start time; the Go and Python clients, and the dashboards
//! written for them, give both to the clock tick.

use std::sync::Mutex;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Counter, Gauge, IntGauge, Opts};

pub struct ProcessCollector {
    cpu: Counter,
    open_fds: IntGauge,
    max_fds: IntGauge,
    virtual_memory: IntGauge,
    resident_memory: IntGauge,
    start_time: Gauge,
    threads: IntGauge,
    /// Two scrapes at once would each add the CPU time gone since the counter's value.
    collecting: Mutex<()>,
}

/// What `/proc/self/stat` says of the process, in its own units.
#[derive(Debug, PartialEq)]
struct Stat {
    /// User plus system time, in clock ticks.
    cpu_ticks: u64,
    threads: i64,
    /// Since boot, in clock ticks.
    start_ticks: u64,
    virtual_bytes: u64,
    resident_pages: u64,
}

impl ProcessCollector {
    pub fn for_self() -> prometheus::Result<Self> {
        let gauge = |name: &str, help: &str| IntGauge::with_opts(Opts::new(name, help));
        let collector = ProcessCollector {
            cpu: Counter::with_opts(Opts::new(
                "process_cpu_seconds_total",
                "Total user and system CPU time spent in seconds.",
            ))?,
            open_fds: gauge("process_open_fds", "Number of open file descriptors.")?,
            max_fds: gauge(
                "process_max_fds",
                "Maximum number of open file descriptors.",
            )?,
            virtual_memory: gauge(
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
            )?,
            resident_memory: gauge(
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
            )?,
            start_time: Gauge::with_opts(Opts::new(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
            ))?,
            threads: gauge("process_threads", "Number of OS threads in the process.")?,
            collecting: Mutex::new(()),
        };
        if let (Some(stat), Some(boot)) = (read_stat(), boot_time()) {
            let started = boot + stat.start_ticks as f64 / ticks_per_second();
            collector.start_time.set(started);
        }
        Ok(collector)
    }

    fn metrics(&self) -> [&dyn Collector; 7] {
        [
            &self.cpu,
            &self.open_fds,
            &self.max_fds,
            &self.virtual_memory,
            &self.resident_memory,
            &self.start_time,
            &self.threads,
        ]
    }
}

impl Collector for ProcessCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.metrics().into_iter().flat_map(|m| m.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|e| e.count() as u64);
        let max_fds = rlimit::Resource::NOFILE.get().ok().map(|(soft, _)| soft);
        self.collect_from(read_stat(), fds, max_fds)
    }
}

impl ProcessCollector {
    /// The families of what could be read: one that could not (no `/proc` in a sandbox,
    /// a hardened mount) is left out, as the Go client leaves it, not given as 0 (a start
    /// time of 0 read as 56 years up; a memory of 0 never fired an alert).
    fn collect_from(
        &self,
        stat: Option<Stat>,
        fds: Option<u64>,
        max_fds: Option<u64>,
    ) -> Vec<MetricFamily> {
        let _one_at_a_time = self
            .collecting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut read: Vec<&dyn Collector> = Vec::with_capacity(7);
        if let Some(stat) = stat {
            let cpu = stat.cpu_ticks as f64 / ticks_per_second();
            let gone = cpu - self.cpu.get();
            if gone > 0.0 {
                self.cpu.inc_by(gone);
            }
            self.threads.set(stat.threads);
            self.virtual_memory.set(clamp(stat.virtual_bytes));
            let page = rustix::param::page_size() as u64;
            self.resident_memory
                .set(clamp(stat.resident_pages.saturating_mul(page)));
            read.extend([
                &self.cpu as &dyn Collector,
                &self.threads,
                &self.virtual_memory,
                &self.resident_memory,
            ]);
        }
        if self.start_time.get() > 0.0 {
            read.push(&self.start_time);
        }
        if let Some(n) = fds {
            self.open_fds.set(clamp(n));
            read.push(&self.open_fds);
        }
        if let Some(soft) = max_fds {
            self.max_fds.set(clamp(soft));
            read.push(&self.max_fds);
        }
        read.into_iter().flat_map(|m| m.collect()).collect()
    }
}

fn ticks_per_second() -> f64 {
    rustix::param::clock_ticks_per_second().max(1) as f64
}

/// Unlimited (`RLIM_INFINITY`) and other values past `i64` read as `i64::MAX`.
fn clamp(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn read_stat() -> Option<Stat> {
    parse_stat(&std::fs::read_to_string("/proc/self/stat").ok()?)
}

/// `proc_pid_stat(5)`: the command name, field 2, is in parentheses and may hold spaces
/// and parentheses itself, so the fields are counted from the last `)`: field 3 first.
fn parse_stat(text: &str) -> Option<Stat> {
    let (_, rest) = text.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        cpu_ticks: field(14)?.saturating_add(field(15)?),
        threads: clamp(field(20)?),
        start_ticks: field(22)?,
        virtual_bytes: field(23)?,
        resident_pages: field(24)?,
    })
}

/// The boot time, in seconds since the epoch: `btime` in `/proc/stat`.
fn boot_time() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(|s| s as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_is_read_from_after_the_command_name() {
        // A command name with a space and a parenthesis of its own.
        let line = "4242 (abx (x) proxy) S 1 4242 4242 0 -1 4194560 1200 0 0 0 \
                    157 43 0 0 20 0 5 0 98765 123456789 2048 18446744073709551615";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                cpu_ticks: 200,
                threads: 5,
                start_ticks: 98765,
                virtual_bytes: 123_456_789,
                resident_pages: 2048,
            })
        );
        assert_eq!(parse_stat("4242 (abx) S 1 2"), None, "cut short");
        assert_eq!(parse_stat("no parenthesis"), None);
    }

    fn value(families: &[MetricFamily], name: &str) -> f64 {
        let family = families
            .iter()
            .find(|f| f.get_name() == name)
            .unwrap_or_else(|| panic!("no {name}"));
        let metric = &family.get_metric()[0];
        match family.get_field_type() {
            prometheus::proto::MetricType::COUNTER => metric.get_counter().get_value(),
            _ => metric.get_gauge().get_value(),
        }
    }

    /// CPU time to the clock tick (it was whole seconds), and the other six as the
    /// kernel has them.
    #[test]
    fn cpu_time_is_exported_to_the_tick() {
        let collector = ProcessCollector::for_self().expect("collector");
        assert_eq!(collector.desc().len(), 7);
        // Work until the process's CPU time is not a whole second (within a second of
        // CPU at most: a tick is a hundredth of one, or less).
        let mut x = 1u64;
        for _ in 0..1000 {
            let ticks = read_stat().expect("stat").cpu_ticks;
            if !ticks.is_multiple_of(ticks_per_second() as u64) {
                break;
            }
            for i in 0..1_000_000u64 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
            }
        }
        let before = read_stat().expect("stat").cpu_ticks as f64 / ticks_per_second();
        let families = collector.collect();
        let after = read_stat().expect("stat").cpu_ticks as f64 / ticks_per_second();
        let cpu = value(&families, "process_cpu_seconds_total");
        assert!(
            before <= cpu && cpu <= after,
            "{before} <= {cpu} <= {after}"
        );
        assert!(
            cpu.fract() != 0.0 || before.fract() == 0.0,
            "{cpu} to the tick"
        );

        assert!(value(&families, "process_threads") >= 1.0);
        assert!(value(&families, "process_resident_memory_bytes") > 1e6);
        let virtual_memory = value(&families, "process_virtual_memory_bytes");
        assert!(virtual_memory >= value(&families, "process_resident_memory_bytes"));
        assert!(value(&families, "process_open_fds") >= 3.0);
        let (soft, _) = rlimit::Resource::NOFILE.get().expect("limit");
        assert_eq!(value(&families, "process_max_fds"), soft as f64);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs_f64();
        let started = value(&families, "process_start_time_seconds");
        assert!(
            now - 3600.0 < started && started <= now,
            "{started} vs {now}"
        );

        // A second scrape counts on from the first, never backwards.
        let again = value(&collector.collect(), "process_cpu_seconds_total");
        assert!(again >= cpu, "{again} >= {cpu}");
    }

    /// What cannot be read is left out, not given as 0.
    #[test]
    fn what_cannot_be_read_is_left_out() {
        let collector = ProcessCollector::for_self().expect("collector");
        let names = |families: Vec<MetricFamily>| -> Vec<String> {
            families.iter().map(|f| f.get_name().to_string()).collect()
        };
        let none = names(collector.collect_from(None, None, Some(1024)));
        // The start time was read when the collector was made.
        assert_eq!(none, ["process_start_time_seconds", "process_max_fds"]);
        assert_eq!(names(collector.collect()).len(), 7);
    }
}
