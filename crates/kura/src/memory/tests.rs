//! `--kv-cache-memory` parsing and resolution, and the readers of /proc and cgroup files, on given text.

use super::*;

const GIB: u64 = 1 << 30;

fn avail(bytes: u64) -> Available {
    Available {
        bytes,
        limited_by: "MemAvailable in /proc/meminfo".into(),
    }
}

/// Parses and resolves `given` against 23 GiB available.
fn resolve(given: &str) -> Result<u64> {
    KvMemoryRequest::parse(given)?.resolve(given, &avail(23 * GIB))
}

fn err(given: &str) -> String {
    format!("{:#}", resolve(given).unwrap_err())
}

#[test]
fn sizes_and_shares_resolve_within_what_is_available() {
    assert_eq!(resolve("1GiB").unwrap(), GIB);
    assert_eq!(resolve(" 512 MiB ").unwrap(), 512 << 20);
    assert_eq!(resolve("0.25").unwrap(), 23 * GIB / 4);
    assert_eq!(resolve("25%").unwrap(), 23 * GIB / 4);
    assert_eq!(
        resolve("90%").unwrap(),
        (23.0 * GIB as f64 * 0.9).floor() as u64
    );
    // The largest share that fits: 95 % (5 % of 23 GiB is more than the 256 MiB minimum).
    assert_eq!(
        resolve("95%").unwrap(),
        (23.0 * GIB as f64 * 0.95).floor() as u64
    );
    assert_eq!(
        KvMemoryRequest::parse("1.").unwrap(),
        KvMemoryRequest::Share(1.0)
    );
}

#[test]
fn more_than_is_available_says_what_is_needed_available_and_which_flag() {
    // 1TB on a 23 GiB machine was accepted and the server was killed while zeroing it.
    let e = err("1TB");
    assert!(e.starts_with("--kv-cache-memory 1TB asks for 931.32 GiB but 23.00 GiB is available (MemAvailable in /proc/meminfo)"), "{e}");
    assert!(e.contains("1.15 GiB of it must stay free"), "{e}");
    assert!(
        e.contains("give at most --kv-cache-memory 22374MiB (or 95%)"),
        "{e}"
    );
    // u64::MAX bytes aborted in the allocator.
    let e = err("18446744073709551615");
    assert!(e.contains("asks for 16777216.00 TiB but 23.00 GiB"), "{e}");
    // 100 % leaves nothing for the rest of the server (it was killed, rc 137).
    let e = err("100%");
    assert!(
        e.contains("asks for 23.00 GiB") && e.contains("(or 95%)"),
        "{e}"
    );
    assert!(err("1.0").contains("(or 95%)"));
    // Just over the limit.
    let usable = 23 * GIB - reserve_bytes(23 * GIB);
    assert_eq!(resolve(&usable.to_string()).unwrap(), usable);
    assert!(resolve(&(usable + 1).to_string()).is_err());
}

#[test]
fn degenerate_values_are_named_errors() {
    for (given, why) in [
        ("0", "is no memory at all"),
        ("0B", "is no memory at all"),
        (
            "0%",
            "a share of the available memory is a fraction in (0, 1]",
        ),
        ("0.0", "a fraction in (0, 1]"),
        ("150%", "a percentage in (0%, 100%]"),
        ("1.5", "a size takes a unit: 1.5GiB"),
        ("-0.5", "a fraction in (0, 1]"),
        ("NaN%", "a fraction in (0, 1]"),
        ("inf%", "a fraction in (0, 1]"),
        ("%", "a fraction in (0, 1]"),
        ("-1", "must be a non-negative number"),
        ("NaN", "not a number"),
        ("inf", "not a number"),
        ("1e400", "must be a non-negative number"),
        ("", "not a number"),
        ("lots", "not a number"),
        ("12 parsecs", "unknown unit"),
    ] {
        let e = format!("{:#}", KvMemoryRequest::parse(given).unwrap_err());
        assert!(e.starts_with("--kv-cache-memory"), "{given}: {e}");
        assert!(e.contains(why), "{given}: {e}");
    }
}

#[test]
fn too_little_memory_for_even_the_reserve_is_named() {
    let e = KvMemoryRequest::Share(0.5)
        .resolve("50%", &avail(100 << 20))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("only 100.00 MiB is available") && e.contains("free some memory"),
        "{e}"
    );
    // The minimum reserve applies to small machines, 5 % to large ones.
    assert_eq!(reserve_bytes(GIB), MIN_RESERVE_BYTES);
    assert_eq!(reserve_bytes(100 * GIB), 5 * GIB);
}

const MEMINFO: &str = "MemTotal:       24684084 kB\nMemFree:        22292160 kB\n\
                       MemAvailable:   23562484 kB\nBuffers:           14700 kB\n";

#[test]
fn meminfo_is_read_in_kib_and_missing_or_bad_fields_are_named() {
    assert_eq!(
        parse_meminfo(MEMINFO).unwrap(),
        Meminfo {
            total: 24684084 * 1024,
            available: 23562484 * 1024,
        }
    );
    let no_avail = "MemTotal: 100 kB\nMemFree: 50 kB\n";
    assert_eq!(
        parse_meminfo(no_avail).unwrap_err().to_string(),
        "/proc/meminfo has no MemAvailable line"
    );
    let bad = "MemTotal: lots kB\nMemAvailable: 1 kB\n";
    assert!(parse_meminfo(bad)
        .unwrap_err()
        .to_string()
        .contains("MemTotal is \"lots kB\""));
    let huge = format!("MemTotal: {} kB\nMemAvailable: 1 kB\n", u64::MAX);
    assert!(parse_meminfo(&huge)
        .unwrap_err()
        .to_string()
        .contains("overflows"));
    assert!(parse_meminfo("").is_err());
    // A name that only starts like another is not it.
    assert!(parse_meminfo("MemTotalX: 1 kB\nMemAvailable: 1 kB\n").is_err());
}

#[test]
fn cgroup_headroom_counts_inactive_file_pages_as_free() {
    assert_eq!(cgroup_headroom("max\n", "123\n", None).unwrap(), None);
    assert_eq!(
        cgroup_headroom("9223372036854771712\n", "524013568\n", None).unwrap(),
        None,
        "cgroup v1's unlimited"
    );
    let v2_stat = "anon 1000\nfile 5000\nactive_file 1000\ninactive_file 4000\n";
    assert_eq!(
        cgroup_headroom("10000\n", "8000\n", Some(v2_stat)).unwrap(),
        Some(10000 - (8000 - 4000))
    );
    let v1_stat = "inactive_file 10\ntotal_inactive_file 3000\n";
    assert_eq!(
        cgroup_headroom("10000", "8000", Some(v1_stat)).unwrap(),
        Some(5000)
    );
    // Over the limit (usage can exceed a lowered limit): nothing left, no underflow.
    assert_eq!(cgroup_headroom("100", "500", None).unwrap(), Some(0));
    assert!(cgroup_headroom("lots", "1", None).is_err());
    assert!(cgroup_headroom("100", "", None).is_err());
}

#[test]
fn the_tightest_limit_wins_and_is_named() {
    let mut sources = MemorySources {
        meminfo: MEMINFO.into(),
        ..MemorySources::default()
    };
    let a = available_from(&sources).unwrap();
    assert_eq!(a.bytes, 23562484 * 1024);
    assert!(a
        .limited_by
        .starts_with("MemAvailable in /proc/meminfo, of 23.54 GiB"));
    sources.cgroups.push((
        "/sys/fs/cgroup/memory.max".into(),
        (8 * GIB).to_string(),
        (2 * GIB).to_string(),
        None,
    ));
    let a = available_from(&sources).unwrap();
    assert_eq!(a.bytes, 6 * GIB);
    assert_eq!(
        a.limited_by,
        "under the cgroup limit /sys/fs/cgroup/memory.max = 8589934592"
    );
    sources.limits = Some(
        "Limit                     Soft Limit           Hard Limit           Units     \n\
         Max data size             unlimited            unlimited            bytes     \n\
         Max address space         4294967296           unlimited            bytes     \n"
            .into(),
    );
    sources.status = Some("VmPeak:\t  5000 kB\nVmSize:\t 1048576 kB\nVmData:\t 1000 kB\n".into());
    let a = available_from(&sources).unwrap();
    assert_eq!(a.bytes, 3 * GIB);
    assert!(a
        .limited_by
        .starts_with("under RLIMIT_AS (ulimit -v) of 4.00 GiB, 1.00 GiB already"));
    // 1TB against it names the rlimit.
    let e = KvMemoryRequest::parse("1TB")
        .unwrap()
        .resolve("1TB", &a)
        .unwrap_err();
    assert!(e.to_string().contains("RLIMIT_AS"), "{e}");
    sources.cgroups[0].1 = "garbage".into();
    assert!(format!("{:#}", available_from(&sources).unwrap_err()).contains("memory.max"));
}

#[test]
fn cgroup_directories_are_found_for_v1_and_v2() {
    let root = std::env::temp_dir().join(format!("kura-cgroup-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("a/b")).unwrap();
    std::fs::create_dir_all(root.join("memory/x")).unwrap();
    let dirs = cgroup_dirs("0::/a/b\n4:memory:/x/y\n3:cpu:/z\n", &root);
    assert_eq!(
        dirs,
        vec![
            (root.join("a/b"), CgroupVersion::V2),
            (root.join("a"), CgroupVersion::V2),
            (root.clone(), CgroupVersion::V2),
            (root.join("memory/x"), CgroupVersion::V1),
            (root.join("memory"), CgroupVersion::V1),
        ]
    );
    // A climbing path reads only the mount's root.
    assert_eq!(
        cgroup_dirs("0::/../../etc\n", &root),
        vec![(root.clone(), CgroupVersion::V2)]
    );
    assert!(cgroup_dirs("garbage\n", &root).is_empty());
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn this_machine_reports_something_available() {
    let a = available_now().unwrap();
    assert!(a.bytes > 0, "{a:?}");
    assert!(total_memory_bytes().unwrap() > 0);
}
