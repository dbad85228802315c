//! The Prometheus text exposition format (version 0.0.4), as Kura writes it: each family is a `# HELP`
//! line, a `# TYPE` line, then its samples, one a line (`name{label="value",…} value`).

use std::fmt::{self, Write as _};

use crate::Histogram;

/// A family's type, as its `# TYPE` line names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A sample's value: a count, written as an integer, or a measurement, written as Rust writes an `f64`
/// (the shortest digits that read back the same, never an exponent: `0.25`, `3`, `0.00000015`), with `+Inf`, `-Inf` and `NaN` as the
/// format spells them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    Int(u64),
    Float(f64),
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(v)
    }
}

impl From<usize> for Value {
    fn from(v: usize) -> Self {
        Value::Int(v as u64)
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Float(v)
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Value::Int(v) => write!(f, "{v}"),
            Value::Float(v) if v.is_nan() => f.write_str("NaN"),
            Value::Float(v) if v == f64::INFINITY => f.write_str("+Inf"),
            Value::Float(v) if v == f64::NEG_INFINITY => f.write_str("-Inf"),
            Value::Float(v) => write!(f, "{v}"),
        }
    }
}

/// The text of one scrape. Families are written in call order; a labelled family is [`family`] then one
/// [`sample`] (or [`histogram_series`]) per label set, an unlabelled one a single call ([`counter`],
/// [`gauge`], [`histogram`]).
///
/// Metric and label names are Kura's own constants (checked in debug builds); label values and help texts
/// may be anything and are escaped.
///
/// [`family`]: Exposition::family
/// [`sample`]: Exposition::sample
/// [`histogram_series`]: Exposition::histogram_series
/// [`counter`]: Exposition::counter
/// [`gauge`]: Exposition::gauge
/// [`histogram`]: Exposition::histogram
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    pub fn new() -> Self {
        Self::default()
    }

    /// An exposition with room for `bytes` of text before it reallocates.
    pub fn with_capacity(bytes: usize) -> Self {
        Self {
            out: String::with_capacity(bytes),
        }
    }

    /// Opens a family: its `# HELP` and `# TYPE` lines. Its samples follow.
    pub fn family(&mut self, name: &str, help: &str, kind: Kind) {
        debug_assert!(is_metric_name(name), "bad metric name {name:?}");
        self.out.push_str("# HELP ");
        self.out.push_str(name);
        self.out.push(' ');
        for c in help.chars() {
            match c {
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                c => self.out.push(c),
            }
        }
        self.out.push_str("\n# TYPE ");
        self.out.push_str(name);
        self.out.push(' ');
        self.out.push_str(kind.as_str());
        self.out.push('\n');
    }

    /// One sample of the family just opened: `name{labels} value`, or `name value` without labels.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl Into<Value>) {
        self.sample_with(name, labels, None, value.into());
    }

    /// An unlabelled counter: the family and its one sample.
    pub fn counter(&mut self, name: &str, help: &str, value: impl Into<Value>) {
        self.family(name, help, Kind::Counter);
        self.sample(name, &[], value);
    }

    /// An unlabelled gauge: the family and its one sample.
    pub fn gauge(&mut self, name: &str, help: &str, value: impl Into<Value>) {
        self.family(name, help, Kind::Gauge);
        self.sample(name, &[], value);
    }

    /// An unlabelled histogram: the family and its series.
    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.family(name, help, Kind::Histogram);
        self.histogram_series(name, &[], h);
    }

    /// One histogram series of the family just opened, with `labels` on each of its lines: a
    /// `name_bucket` per bound (cumulative, `le` after the other labels), `le="+Inf"`, then `name_sum`
    /// (seconds) and `name_count`.
    pub fn histogram_series(&mut self, name: &str, labels: &[(&str, &str)], h: &Histogram) {
        let snapshot = h.snapshot();
        let bucket = format!("{name}_bucket");
        let mut bound = String::new();
        for (le, cumulative) in snapshot.buckets {
            bound.clear();
            let _ = write!(bound, "{le}");
            self.sample_with(
                &bucket,
                labels,
                Some(("le", &bound)),
                Value::Int(cumulative),
            );
        }
        self.sample_with(
            &bucket,
            labels,
            Some(("le", "+Inf")),
            Value::Int(snapshot.count),
        );
        self.sample_with(
            &format!("{name}_sum"),
            labels,
            None,
            Value::Float(snapshot.sum_s),
        );
        self.sample_with(
            &format!("{name}_count"),
            labels,
            None,
            Value::Int(snapshot.count),
        );
    }

    /// The text written so far.
    pub fn as_str(&self) -> &str {
        &self.out
    }

    /// The finished text.
    pub fn finish(self) -> String {
        self.out
    }

    fn sample_with(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        last: Option<(&str, &str)>,
        value: Value,
    ) {
        debug_assert!(is_metric_name(name), "bad metric name {name:?}");
        self.out.push_str(name);
        let mut labels = labels.iter().copied().chain(last).peekable();
        if labels.peek().is_some() {
            self.out.push('{');
            for (i, (label, v)) in labels.enumerate() {
                debug_assert!(is_label_name(label), "bad label name {label:?}");
                if i > 0 {
                    self.out.push(',');
                }
                self.out.push_str(label);
                self.out.push_str("=\"");
                for c in v.chars() {
                    match c {
                        '\\' => self.out.push_str("\\\\"),
                        '"' => self.out.push_str("\\\""),
                        '\n' => self.out.push_str("\\n"),
                        c => self.out.push(c),
                    }
                }
                self.out.push('"');
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*`
fn is_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `[a-zA-Z_][a-zA-Z0-9_]*`, not starting with the reserved `__`.
fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    !name.starts_with("__")
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn counters_and_gauges_are_help_type_and_one_sample() {
        let mut e = Exposition::new();
        e.counter("kura:x_total", "Things done.", 42u64);
        e.gauge("kura:y", "A level.", 0.25);
        e.gauge("kura:z", "Whole.", 3.0);
        e.counter("kura:s_seconds_total", "Time.", 1.5e-7);
        assert_eq!(
            e.finish(),
            "# HELP kura:x_total Things done.\n# TYPE kura:x_total counter\nkura:x_total 42\n\
             # HELP kura:y A level.\n# TYPE kura:y gauge\nkura:y 0.25\n\
             # HELP kura:z Whole.\n# TYPE kura:z gauge\nkura:z 3\n\
             # HELP kura:s_seconds_total Time.\n# TYPE kura:s_seconds_total counter\n\
             kura:s_seconds_total 0.00000015\n"
        );
    }

    #[test]
    fn special_floats_are_spelled_as_the_format_wants() {
        assert_eq!(Value::from(f64::INFINITY).to_string(), "+Inf");
        assert_eq!(Value::from(f64::NEG_INFINITY).to_string(), "-Inf");
        assert_eq!(Value::from(f64::NAN).to_string(), "NaN");
        assert_eq!(Value::from(-2.5).to_string(), "-2.5");
        assert_eq!(Value::from(u64::MAX).to_string(), "18446744073709551615");
        assert_eq!(Value::from(7usize).to_string(), "7");
    }

    #[test]
    fn labelled_families_write_one_sample_per_label_set() {
        let mut e = Exposition::new();
        e.family("kura:r_total", "By reason.", Kind::Counter);
        e.sample("kura:r_total", &[("reason", "a")], 1u64);
        e.sample("kura:r_total", &[("reason", "b"), ("tier", "host")], 2u64);
        assert_eq!(
            e.as_str(),
            "# HELP kura:r_total By reason.\n# TYPE kura:r_total counter\n\
             kura:r_total{reason=\"a\"} 1\nkura:r_total{reason=\"b\",tier=\"host\"} 2\n"
        );
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        let mut e = Exposition::new();
        e.family(
            "kura:u",
            "Back\\slash and\nnewline, \"quotes\" kept.",
            Kind::Gauge,
        );
        e.sample("kura:u", &[("replica", "a\\b\"c\nd")], 1u64);
        assert_eq!(
            e.finish(),
            "# HELP kura:u Back\\\\slash and\\nnewline, \"quotes\" kept.\n# TYPE kura:u gauge\n\
             kura:u{replica=\"a\\\\b\\\"c\\nd\"} 1\n"
        );
    }

    #[test]
    fn histograms_are_cumulative_buckets_inf_sum_and_count() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(30));
        h.observe(Duration::from_millis(30));
        h.observe(Duration::from_secs(1000));
        let mut e = Exposition::new();
        e.histogram("kura:l_seconds", "Latency.", &h);
        let text = e.finish();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2 + 18 + 3, "{text}");
        assert_eq!(lines[0], "# HELP kura:l_seconds Latency.");
        assert_eq!(lines[1], "# TYPE kura:l_seconds histogram");
        assert_eq!(lines[2], "kura:l_seconds_bucket{le=\"0.001\"} 1");
        assert_eq!(lines[3], "kura:l_seconds_bucket{le=\"0.0025\"} 1");
        assert_eq!(lines[6], "kura:l_seconds_bucket{le=\"0.025\"} 1");
        assert_eq!(lines[7], "kura:l_seconds_bucket{le=\"0.05\"} 3");
        assert_eq!(lines[12], "kura:l_seconds_bucket{le=\"1\"} 3");
        assert_eq!(lines[19], "kura:l_seconds_bucket{le=\"300\"} 3");
        assert_eq!(lines[20], "kura:l_seconds_bucket{le=\"+Inf\"} 4");
        assert_eq!(lines[21], "kura:l_seconds_sum 1000.0605");
        assert_eq!(lines[22], "kura:l_seconds_count 4");
        // Every bucket's bound is one of the latency buckets, in order, and the counts never fall.
        let mut last = 0;
        for (line, bound) in lines[2..20].iter().zip(crate::LATENCY_BUCKETS_S) {
            let (head, count) = line.rsplit_once(' ').unwrap();
            assert_eq!(head, format!("kura:l_seconds_bucket{{le=\"{bound}\"}}"));
            let count: u64 = count.parse().unwrap();
            assert!(count >= last, "{line}");
            last = count;
        }
    }

    #[test]
    fn labelled_histogram_series_put_le_last_and_label_sum_and_count() {
        let h = Histogram::default();
        h.observe(Duration::from_millis(2));
        let mut e = Exposition::new();
        e.family("kura:t_seconds", "Per tier.", Kind::Histogram);
        e.histogram_series("kura:t_seconds", &[("tier", "host")], &h);
        e.histogram_series("kura:t_seconds", &[("tier", "disk")], &Histogram::default());
        let text = e.finish();
        assert_eq!(text.matches("# TYPE").count(), 1);
        assert!(text.contains("kura:t_seconds_bucket{tier=\"host\",le=\"0.001\"} 0\n"));
        assert!(text.contains("kura:t_seconds_bucket{tier=\"host\",le=\"0.0025\"} 1\n"));
        assert!(text.contains("kura:t_seconds_bucket{tier=\"host\",le=\"+Inf\"} 1\n"));
        assert!(text.contains("kura:t_seconds_sum{tier=\"host\"} 0.002\n"));
        assert!(text.contains("kura:t_seconds_count{tier=\"host\"} 1\n"));
        assert!(text.contains("kura:t_seconds_bucket{tier=\"disk\",le=\"+Inf\"} 0\n"));
        assert!(text.contains("kura:t_seconds_sum{tier=\"disk\"} 0\n"));
        assert!(text.contains("kura:t_seconds_count{tier=\"disk\"} 0\n"));
        assert_eq!(text.lines().count(), 2 + 2 * (18 + 3));
    }

    #[test]
    fn names_are_checked() {
        assert!(is_metric_name("kura:kv_cache_usage_perc"));
        assert!(is_metric_name("kura_router:in_flight"));
        assert!(!is_metric_name("9lives"));
        assert!(!is_metric_name("a-b"));
        assert!(!is_metric_name(""));
        assert!(is_label_name("finished_reason"));
        assert!(!is_label_name("le-x"));
        assert!(!is_label_name("__name__"));
        assert!(!is_label_name(""));
    }
}
