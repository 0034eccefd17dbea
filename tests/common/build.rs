//! Building and locating the library, the command and the test programs.

use super::*;

/// target/<profile>, from this test binary's path (target/<profile>/deps/<test>).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// Builds the preload library and the CLI once per test binary, in this binary's profile.
fn build() {
    static BUILD: Once = Once::new();
    BUILD.call_once(|| {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args([
            "build",
            "-q",
            "-p",
            "tllm-affinity-preload",
            "-p",
            "tllm-affinity",
            "--lib",
            "--bins",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
        if target_dir().ends_with("release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("cargo build");
        assert!(
            status.success(),
            "building the preload library and the CLI failed"
        );
    });
}

/// The real `libtllm_affinity.so`, absolute.
pub fn library() -> PathBuf {
    build();
    let lib = target_dir().join("libtllm_affinity.so");
    assert!(lib.exists(), "{} missing", lib.display());
    lib.canonicalize().unwrap()
}

/// `target/<profile>/tllm-affinity`, beside the library (where `run` looks for it).
pub fn cli() -> PathBuf {
    build();
    let bin = target_dir().join("tllm-affinity");
    assert!(bin.exists(), "{} missing", bin.display());
    bin
}

pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A file of `tests/programs`.
pub fn program(name: &str) -> PathBuf {
    programs_dir().join(name)
}

/// `program` with none of the variables that steer the library or the device mapping inherited
/// from the test's own environment, and the Python package importable.
pub fn clean(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        let steering = name.starts_with("TLLM_")
            || [
                "LD_PRELOAD",
                "CUDA_VISIBLE_DEVICES",
                "CUDA_DEVICE_ORDER",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "MV2_COMM_WORLD_LOCAL_RANK",
                "MPI_LOCALRANKID",
                "SLURM_LOCALID",
                "LOCAL_RANK",
                "NO_COLOR",
                "PYTHONPATH",
            ]
            .contains(&name.as_str());
        if steering {
            cmd.env_remove(name);
        }
    }
    cmd.env("PYTHONPATH", repo().join("python"));
    cmd
}

/// The real interpreter (PATH's `python3` may be a shell shim that forks).
pub fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let out = Command::new("python3")
                .args(["-c", "import sys; print(sys.executable)"])
                .output()
                .expect("python3");
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        })
        .clone()
}

pub fn programs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs")
}

/// A C program of `tests/programs`, compiled into target/<profile>/test-programs with
/// `<compiler> -O1 -g -Wall -Wextra -Werror -pthread -o <output> <source> <flags> -ldl`. Every
/// test program goes through here: it is rebuilt only when its source, a header of
/// tests/programs, or the command line changed; one test thread at a time builds, and each build
/// goes to a file of its own renamed into place, so test binaries running at once never see a
/// half-written program.
pub struct Program {
    source: String,
    output: String,
    compiler: Vec<String>,
    flags: Vec<String>,
}

impl Program {
    /// `tests/programs/<source>.c`, built with `cc` as the executable `<source>`.
    pub fn c(source: &str) -> Program {
        Program {
            source: source.to_string(),
            output: source.to_string(),
            compiler: vec!["cc".to_string()],
            flags: Vec::new(),
        }
    }

    /// A shared object (`-fPIC -shared`), `lib<source>.so.2` unless [`Program::named`] says.
    pub fn shared(mut self) -> Program {
        self.output = format!("lib{}.so.2", self.source);
        self.flags
            .splice(0..0, ["-fPIC".to_string(), "-shared".to_string()]);
        self
    }

    /// The output's file name (a path under test-programs).
    pub fn named(mut self, output: &str) -> Program {
        self.output = output.to_string();
        self
    }

    /// Another compiler driver (`mpicc`; zig's `cc` with its target), its words in order.
    pub fn compiler(mut self, words: &[&str]) -> Program {
        self.compiler = words.iter().map(|w| w.to_string()).collect();
        self
    }

    /// Arguments after the source (`-fopenmp`, `-lrt`, link flags).
    pub fn flags(mut self, flags: &[&str]) -> Program {
        self.flags.extend(flags.iter().map(|f| f.to_string()));
        self
    }

    pub fn build(&self) -> PathBuf {
        static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let out = target_dir().join("test-programs").join(&self.output);
        let out_dir = out.parent().unwrap().to_path_buf();
        std::fs::create_dir_all(&out_dir).unwrap();
        let src_path = programs_dir().join(format!("{}.c", self.source));
        let stamp = out.with_extension("args");
        let args = format!("{} {}", self.compiler.join(" "), self.flags.join(" "));
        let headers = std::fs::read_dir(programs_dir())
            .unwrap()
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "h"));
        let newest_input = headers
            .chain([src_path.clone()])
            .filter_map(|p| p.metadata().and_then(|m| m.modified()).ok())
            .max();
        let fresh = out.exists()
            && out.metadata().and_then(|m| m.modified()).ok() >= newest_input
            && std::fs::read_to_string(&stamp).ok().as_deref() == Some(args.as_str());
        if !fresh {
            let name = out.file_name().unwrap().to_string_lossy();
            let tmp = out_dir.join(format!("{name}.tmp{}", std::process::id()));
            let (compiler, words) = self.compiler.split_first().expect("a compiler");
            let built = Command::new(compiler)
                .args(words)
                .args(["-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread", "-o"])
                .arg(&tmp)
                .arg(&src_path)
                .args(&self.flags)
                .arg("-ldl")
                .output()
                .unwrap_or_else(|e| panic!("{compiler}: {e}"));
            assert!(
                built.status.success(),
                "compiling {} failed:\n{}{}",
                src_path.display(),
                String::from_utf8_lossy(&built.stdout),
                String::from_utf8_lossy(&built.stderr)
            );
            std::fs::rename(&tmp, &out).unwrap();
            std::fs::write(&stamp, &args).unwrap();
        }
        out
    }
}

/// `tests/programs/worker_library_routine.c` as `libnccl_routine.so.2`: a start routine the default
/// `TLLM_AFFINITY_WORKER_LIBS` classifies, for the apply path (a host starting a worker).
pub fn worker_library() -> PathBuf {
    Program::c("worker_library_routine")
        .shared()
        .named("libnccl_routine.so.2")
        .build()
}

/// `libopenmp_region.so.2`: tests/programs/openmp_region.c built with `-fopenmp` (a real libgomp
/// pool).
pub fn openmp_library() -> PathBuf {
    Program::c("openmp_region")
        .shared()
        .flags(&["-fopenmp"])
        .build()
}
