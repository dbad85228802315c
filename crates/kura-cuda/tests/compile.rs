//! Every kernel compiles with NVRTC for sm_80 and sm_90a with no register spills, on a machine with no
//! GPU: NVRTC and the CUDA headers come from PyPI (`scripts/fetch-nvrtc.sh`; `scripts/test.sh` sets
//! `KURA_NVRTC_LIB` and `KURA_CUDA_INCLUDE`). A missing NVRTC fails these tests. The machine code of
//! sm_90a's warpgroup kernels is read with nvdisasm (`KURA_NVDISASM`, from the same script): the
//! compiler's own scheduling of asynchronous products is checked where no GPU runs them.

use std::collections::HashMap;

use kura_cuda::device::{in_module, kernel_names};
use kura_cuda::kernels;

/// A kernel that compiles in a moment, for the cache's test.
const SMALL: &str = "extern \"C\" __global__ void add_one(float* x) { x[threadIdx.x] += 1.f; }\n";

// One test an architecture: the two compiles (the longest of these tests) run at once.
#[test]
fn every_kernel_compiles_for_ampere_without_spills() {
    every_kernel_compiles_without_spills("sm_80");
}

#[test]
fn every_kernel_compiles_for_hopper_without_spills() {
    // Compute capability 9.0's module is compiled for sm_90a (its warpgroup products).
    let cubin = every_kernel_compiles_without_spills(kura_cuda::device::compile_arch("sm_90"));
    warpgroup_products_keep_their_registers(&cubin);
}

/// In the machine code of every prefill kernel on warpgroup products (`HGMMA`): no instruction reads or
/// writes a register that a product in flight reads or accumulates into, and no product uses one of a
/// group before it (the products run asynchronously: a group, closed by the product marked `gsb0`, is
/// in flight until a `WARPGROUP.DEPBAR.LE gsb0, N` leaves at most N newer groups; the code is read in
/// address order, each branch's code after the one before),
/// and the Q fragments the score product reads are loaded again in each pass of the key-tile loop,
/// before that product. ptxas of CUDA 13.0 gave Q
/// fragments kept in registers across the loop the registers of P's fragments, so that from the second
/// key tile on the scores came from the previous tile's P (at a head size of 64).
fn warpgroup_products_keep_their_registers(cubin: &[u8]) {
    let listing = disassemble(cubin);
    let names: Vec<String> = kernel_names()
        .into_iter()
        .filter(|n| !in_module(n, "sm_80"))
        .collect();
    assert!(!names.is_empty());
    let mut failures = Vec::new();
    for name in &names {
        let Some(code) = listing.get(name) else {
            failures.push(format!("{name}: not in nvdisasm's listing"));
            continue;
        };
        // (1) Nothing touches an in-flight product's registers.
        failures.extend(
            in_flight_uses(code)
                .into_iter()
                .map(|f| format!("{name}: {f}")),
        );
        // (2) The score product's A fragments (Q) are written inside the loop, before it.
        let scores: Vec<(u64, Hgmma)> = code
            .ins
            .iter()
            .filter_map(|(at, i)| i.hgmma().filter(|g| !g.trans_b).map(|g| (*at, g)))
            .collect();
        let Some(&(first, _)) = scores.first() else {
            failures.push(format!("{name}: no score product in its code"));
            continue;
        };
        let head = code.ins.iter().find_map(|(at, i)| {
            let target = *code.labels.get(i.branch.as_ref()?)?;
            (*at > first && target < first).then_some(target)
        });
        let Some(head) = head else {
            failures.push(format!("{name}: no loop back over the score product"));
            continue;
        };
        for (at, g) in &scores {
            let Some(a) = g.a else {
                failures.push(format!(
                    "{name}: {at:#x}: the score product's A is not in registers"
                ));
                continue;
            };
            // Written in the loop on the way to the product: from the start of its block of code
            // (the last label before it, or the loop's head), where an overlapped kernel has a
            // score product in each of two branches.
            let from = code
                .labels
                .values()
                .copied()
                .filter(|l| *l > head && l <= at)
                .max()
                .unwrap_or(head);
            let written: Vec<u32> = code
                .ins
                .iter()
                .filter(|(i, _)| (from..*at).contains(i))
                .flat_map(|(_, i)| i.dests())
                .collect();
            if let Some(r) = (a..a + 4).find(|r| !written.contains(r)) {
                failures.push(format!(
                    "{name}: {at:#x}: R{r} of the score product's Q fragments is not loaded in the loop \
                     (from {from:#x}) before it"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Where `code` reads or writes a register of a warpgroup product in flight, or a product uses one of a
/// group before it (the rule of [`warpgroup_products_keep_their_registers`]): the groups in flight,
/// oldest first, and the products issued since the last group closed, followed in address order.
fn in_flight_uses(code: &Code) -> Vec<String> {
    let mut failures = Vec::new();
    let mut groups: Vec<Vec<u32>> = Vec::new();
    let mut open: Vec<u32> = Vec::new();
    for (at, ins) in &code.ins {
        if let Some(g) = ins.hgmma() {
            let regs: Vec<u32> = (g.d..g.d + g.n / 2)
                .chain(g.a.map_or(0..0, |a| a..a + 4))
                .collect();
            if let Some(r) = regs.iter().find(|r| groups.iter().any(|g| g.contains(r))) {
                failures.push(format!(
                    "{at:#x} `{}` uses R{r} of a group in flight",
                    ins.text
                ));
            }
            open.extend(regs);
            if ins.text.contains("gsb0") {
                groups.push(std::mem::take(&mut open));
            }
        } else if ins.opcode.starts_with("WARPGROUP.DEPBAR") {
            let Some(keep) = ins.depbar_keep() else {
                failures.push(format!("{at:#x} `{}`: no group count", ins.text));
                continue;
            };
            groups.drain(..groups.len().saturating_sub(keep));
        } else if let Some(r) = ins
            .registers()
            .into_iter()
            .find(|r| open.contains(r) || groups.iter().any(|g| g.contains(r)))
        {
            failures.push(format!(
                "{at:#x} `{}` reads or writes R{r}, in flight",
                ins.text
            ));
        }
    }
    failures
}

#[test]
fn the_machine_code_check_sees_every_use_of_a_register_in_flight() {
    // A score group (accumulators R24..R55, A R88..R91) and a value group (R56..R87, A R92..R95),
    // then a wait that leaves the value group in flight, then one that ends it.
    let listing = |between: &str| {
        format!(
            "\t.text.k:\n\
             /*0000*/ WARPGROUP.ARRIVE ;\n\
             /*0010*/ HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR4], RZ, !UPT, gsb0 ;\n\
             /*0020*/ WARPGROUP.ARRIVE ;\n\
             /*0030*/ HGMMA.64x64x16.F32.BF16 R56, R92, gdesc[UR8].tnspB, R56, gsb0 ;\n\
             /*0040*/ WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\n\
             /*0050*/ {between} ;\n\
             /*0060*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n\
             /*0070*/ FMUL R56, R56, R1 ;\n"
        )
    };
    let uses = |between: &str| in_flight_uses(&parse_listing(&listing(between))["k"]);
    // The scores, done, are free; so are registers no product names.
    for clean in [
        "FMUL R24, R24, R2",
        "SHFL.BFLY PT, R55, R54, 0x1, 0x1f",
        "MOV R96, R88",
        "LDS.64 R96, [R2.64]",
    ] {
        assert_eq!(uses(clean), Vec::<String>::new(), "{clean}");
    }
    // The value group's accumulators and A, written or read, by any form of operand.
    for hazard in [
        "FMUL R60, R60, R2",                 // an accumulator written and read
        "SHFL.BFLY PT, R87, R54, 0x1, 0x1f", // written after a predicate
        "FADD R2, R57, R3",                  // an accumulator read
        "F2FP.BF16.F32.PACK_AB R95, R3, R2", // A overwritten
        "LDS.64 R86, [R2]",                  // the second register of a wide load
        "STS.128 [R2], R84",                 // the data of a wide store
        "IMAD.WIDE R86, R2, 0x4, RZ",        // the second register of a wide result
        "LDG.E R2, desc[UR4][R92.64]",       // an address register pair
        "HGMMA.64x64x16.F32.BF16 R56, R88, gdesc[UR4], R56, gsb0", // a product into a group in flight
    ] {
        assert_eq!(uses(hazard).len(), 1, "{hazard}: {:?}", uses(hazard));
    }
}

/// One instruction of nvdisasm's listing.
struct Ins {
    text: String,
    opcode: String,
    /// The register it writes, where its first operand is one (`R12`).
    dest: Option<u32>,
    /// The label a branch goes to.
    branch: Option<String>,
}

/// A warpgroup product: `n` columns, accumulators from `d`, A from `a` (None: from shared memory).
struct Hgmma {
    n: u32,
    d: u32,
    a: Option<u32>,
    trans_b: bool,
}

fn reg(op: &str) -> Option<u32> {
    op.trim().strip_prefix('R')?.parse().ok()
}

impl Ins {
    fn parse(text: &str) -> Ins {
        let mut words = text.split_whitespace().peekable();
        if words.peek().is_some_and(|w| w.starts_with('@')) {
            words.next();
        }
        let opcode = words.next().unwrap_or_default().to_string();
        let operands: Vec<&str> = text
            .split_once(opcode.as_str())
            .map_or("", |(_, rest)| rest)
            .split(',')
            .collect();
        let dest = if opcode.starts_with("HGMMA") || opcode.starts_with("ST") {
            None
        } else {
            operands.first().and_then(|o| reg(o))
        };
        let branch = opcode
            .starts_with("BRA")
            .then(|| {
                text.split("(")
                    .nth(1)?
                    .split(')')
                    .next()
                    .map(str::to_string)
            })
            .flatten();
        Ins {
            text: text.to_string(),
            opcode,
            dest,
            branch,
        }
    }

    /// The registers it writes: [`Self::dest`] and, for a wider result, the ones after it (`.64`:
    /// two, `.128`: four; `LDSM` `.X2`/`.X4`: two or four; `IMAD.WIDE`: two).
    fn dests(&self) -> impl Iterator<Item = u32> {
        let o = self.opcode.as_str();
        let width = if o.contains(".128") || (o.starts_with("LDSM") && o.contains(".X4")) {
            4
        } else if o.contains(".64")
            || o.contains(".WIDE")
            || (o.starts_with("LDSM") && o.contains(".X2"))
        {
            2
        } else {
            1
        };
        self.dest.into_iter().flat_map(move |d| d..d + width)
    }

    /// Every register it names, read or written: its destination as wide as [`Self::dests`] says, a
    /// store's data as wide as the store, an address register two wide where marked `.64` (`[R2.64]`),
    /// any other one.
    fn registers(&self) -> Vec<u32> {
        let dest_width = self.dests().count().max(1) as u32;
        let store_width = if self.opcode.contains(".128") {
            4
        } else if self.opcode.contains(".64") {
            2
        } else {
            1
        };
        let store = self.opcode.starts_with("ST");
        let operands = self
            .text
            .split_once(self.opcode.as_str())
            .map_or("", |(_, rest)| rest);
        let bytes = operands.as_bytes();
        let mut regs = Vec::new();
        let (mut i, mut in_address, mut first) = (0, false, true);
        while i < bytes.len() {
            match bytes[i] {
                b'[' => in_address = true,
                b']' => in_address = false,
                _ => {}
            }
            let starts = bytes[i] == b'R'
                && (i == 0 || !bytes[i - 1].is_ascii_alphanumeric())
                && bytes.get(i + 1).is_some_and(u8::is_ascii_digit);
            if !starts {
                i += 1;
                continue;
            }
            let digits = bytes[i + 1..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            let end = i + 1 + digits;
            let r: u32 = operands[i + 1..end].parse().unwrap_or(u32::MAX);
            let wide = operands[end..].starts_with(".64");
            let width = if in_address {
                if wide {
                    2
                } else {
                    1
                }
            } else if first && self.dest == Some(r) {
                dest_width
            } else if store {
                store_width
            } else if wide {
                2
            } else {
                1
            };
            if !in_address {
                first = false;
            }
            regs.extend(r..r.saturating_add(width));
            i = end;
        }
        regs
    }

    /// N of `WARPGROUP.DEPBAR.LE gsb0, N`: the groups it leaves in flight.
    fn depbar_keep(&self) -> Option<usize> {
        let n = self.text.rsplit(',').next()?.trim();
        usize::from_str_radix(n.strip_prefix("0x")?, 16).ok()
    }

    fn hgmma(&self) -> Option<Hgmma> {
        let shape = self.opcode.strip_prefix("HGMMA.64x")?;
        let n = shape.split('x').next()?.parse().ok()?;
        let mut ops = self
            .text
            .split_once(self.opcode.as_str())?
            .1
            .split(',')
            .map(str::trim);
        let d = reg(ops.next()?)?;
        let a = reg(ops.next()?);
        Some(Hgmma {
            n,
            d,
            a,
            trans_b: self.text.contains("tnspB"),
        })
    }
}

/// A kernel's instructions (address, instruction) and its labels' addresses.
#[derive(Default)]
struct Code {
    ins: Vec<(u64, Ins)>,
    labels: HashMap<String, u64>,
}

/// Every kernel of `cubin` as nvdisasm lists it (`KURA_NVDISASM`).
fn disassemble(cubin: &[u8]) -> HashMap<String, Code> {
    let nvdisasm = std::env::var_os("KURA_NVDISASM")
        .expect("KURA_NVDISASM names nvdisasm (scripts/fetch-nvrtc.sh fetches it)");
    let path = std::env::temp_dir().join(format!("kura-sm90a-{}.cubin", std::process::id()));
    std::fs::write(&path, cubin).unwrap();
    let out = std::process::Command::new(&nvdisasm)
        .arg("-c")
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", std::path::Path::new(&nvdisasm).display()));
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "nvdisasm: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_listing(&String::from_utf8_lossy(&out.stdout))
}

/// nvdisasm's listing (`-c`) as kernels.
fn parse_listing(listing: &str) -> HashMap<String, Code> {
    let mut kernels: HashMap<String, Code> = HashMap::new();
    let mut current: Option<String> = None;
    let mut pending: Vec<String> = Vec::new();
    for line in listing.lines() {
        let t = line.trim();
        if let Some(name) = t.strip_prefix(".text.").and_then(|r| r.strip_suffix(':')) {
            current = Some(name.to_string());
            pending.clear();
        } else if let Some(label) = t.strip_suffix(':').filter(|l| l.starts_with(".L")) {
            pending.push(label.to_string());
        } else if let (Some(name), Some(rest)) = (&current, t.strip_prefix("/*")) {
            let Some((addr, ins)) = rest.split_once("*/") else {
                continue;
            };
            let Ok(at) = u64::from_str_radix(addr.trim(), 16) else {
                continue;
            };
            let ins = ins.trim().trim_end_matches(';').trim();
            let code = kernels.entry(name.clone()).or_default();
            for l in pending.drain(..) {
                code.labels.insert(l, at);
            }
            code.ins.push((at, Ins::parse(ins)));
        }
    }
    kernels
}

fn every_kernel_compiles_without_spills(arch: &str) -> Vec<u8> {
    let include = kernels::include_dir().expect("CUDA headers (run scripts/fetch-nvrtc.sh)");
    let version = kernels::nvrtc_version().expect("NVRTC (run scripts/fetch-nvrtc.sh)");
    assert!(version.0 >= 12, "NVRTC {version:?}");
    let c = kernels::compile(arch, &include).unwrap_or_else(|e| panic!("{e}"));
    assert!(c.cubin.starts_with(b"\x7fELF"), "{arch}: not a cubin");
    let reported = kernels::kernels_reported(&c.log);
    for k in kernel_names() {
        // The prefill forms on warpgroup products are in sm_90a's module only.
        assert_eq!(
            reported.iter().any(|r| r == &k),
            in_module(&k, arch),
            "{arch}: kernel {k} in ptxas' report: {}; in the module: {}\n{}",
            reported.iter().any(|r| r == &k),
            in_module(&k, arch),
            c.log
        );
    }
    // ptxas makes every warpgroup product of a kernel wait for the one before where it cannot prove
    // their operands safe (a product in flight across a branch it cannot prove uniform, for one), and
    // says so as a "Potential Performance Loss".
    let serialized: Vec<&str> = c
        .log
        .lines()
        .filter(|l| l.contains("Potential Performance Loss"))
        .collect();
    assert!(serialized.is_empty(), "{arch}: {serialized:#?}");
    let spills = kernels::spills(&c.log);
    assert!(
        spills.is_empty(),
        "{arch}: kernels spill: {spills:?}\n{}",
        c.log
    );
    // Each kernel's registers and shared memory, for the record (`cargo test -- --nocapture`).
    let mut kernel = "";
    for line in c.log.lines() {
        if let Some(name) = line.split("Function properties for ").nth(1) {
            kernel = name.trim();
        } else if line.contains("registers") {
            let used = line.split("Used ").nth(1).unwrap_or(line).trim();
            println!("{arch}: {kernel}: {used}");
        }
    }
    c.cubin
}

#[test]
fn the_kernel_cache_compiles_once_and_then_reads() {
    let dir = std::env::temp_dir().join(format!("kura-kcache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // A small source, compiled in a moment: the cache's logic is `cubin_for`'s for Kura's kernels (whose
    // compiles, the longest of these tests, the tests above run once an architecture).
    let cached = |arch: &str, dir: &std::path::Path| kernels::cubin_of(SMALL, arch, dir);
    let (first, compiled) = cached("sm_90", &dir).unwrap_or_else(|e| panic!("{e}"));
    assert!(compiled, "an empty cache compiles");
    let (second, compiled_again) = cached("sm_90", &dir).unwrap();
    assert!(!compiled_again, "the second start reads the cache");
    assert_eq!(first, second);
    // A damaged file is compiled anew, not loaded.
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "cubin"))
        .unwrap();
    std::fs::write(&file, b"not a cubin").unwrap();
    let (third, recompiled) = cached("sm_90", &dir).unwrap();
    assert!(recompiled);
    assert_eq!(
        third, first,
        "NVRTC compiles the same source to the same cubin"
    );
    // A path that is not a regular file is never opened (a FIFO would block the start): compiled
    // anew, and the compile cannot replace it, which is an error naming the cache.
    std::fs::remove_file(&file).unwrap();
    std::fs::create_dir(&file).unwrap();
    let e = cached("sm_90", &dir).unwrap_err().to_string();
    assert!(e.contains(&dir.display().to_string()), "{e}");
    std::fs::remove_dir(&file).unwrap();
    // Another architecture is another key.
    assert_ne!(
        kernels::cache_key("sm_80", (13, 0)),
        kernels::cache_key("sm_90", (13, 0))
    );
    assert_ne!(
        kernels::cache_key("sm_90", (13, 0)),
        kernels::cache_key("sm_90", (13, 1))
    );
    // Another source is another key.
    assert_ne!(
        kernels::cache_key_of(SMALL, "sm_90", (13, 0)),
        kernels::cache_key("sm_90", (13, 0))
    );
    let _ = std::fs::remove_dir_all(&dir);
}
