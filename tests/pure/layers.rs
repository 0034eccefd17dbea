//! The layers, read from the sources (issues 16, 30, 49, 61): the core's folders each use only the
//! folders below them (the leaves at `src/`'s root, then `handoff`, `host`, `table`, `placement`,
//! `registry`, `engine`), no two modules depend on each other round a cycle, no file of the engine
//! names another round a cycle, `unsafe` is allowed only on the modules `src/lib.rs` lists for it,
//! the CLI crate (`cli/`, which the compiler already keeps the core from naming) names the core but
//! never the engine, has no `unsafe` and no cycle among its modules, and the Python package
//! (`python/`) imports round no cycle.
//!
//! A module's dependencies are the `crate::<module>` paths its code names (`crate::<folder>::<file>`
//! for a file of a folder, and `super::<file>` from inside one), over its file and, for a
//! directory module such as the registry, every file under it; inside the engine, a file's are the
//! `super::<file>` and `crate::engine::<file>` paths it names, in `use` lines or inline. The
//! engine's `mod.rs` only names its files and hands on the C ABI's functions, so a file names
//! another by its home: `super::lock_registry` through a re-export would hide the arrow, and is
//! refused. Comments are left out (a doc link is no dependency), and so are `#[cfg(test)]` items:
//! a unit test may write any module's simulated host.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The modules the compiler lets use `unsafe`, each for a reason `src/lib.rs`'s doc gives.
const UNSAFE_ALLOWED: [&str; 5] = ["engine", "lock", "host::nvml", "sys", "table::untrusted"];
/// The core's layers, bottom first: the leaves at `src/`'s root (""), then its folders. A module
/// names only modules of its own layer or below.
const LAYERS: [&str; 7] = [
    "",
    "handoff",
    "host",
    "table",
    "placement",
    "registry",
    "engine",
];

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Code without its `//` comments (doc comments included), so a doc link is no dependency.
fn code_of(text: &str) -> String {
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `code` without its `#[cfg(test)]` items: each runs to the `;` or the brace that closes it.
fn without_test_items(code: &str) -> String {
    const MARK: &str = "#[cfg(test)]";
    let mut kept = String::new();
    let mut rest = code;
    while let Some(at) = rest.find(MARK) {
        kept.push_str(&rest[..at]);
        rest = &rest[at + MARK.len()..];
        let mut depth = 0;
        let mut end = rest.len();
        for (i, c) in rest.char_indices() {
            match c {
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    kept.push_str(rest);
    kept
}

fn ident_at(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The top-level names after each `crate::` (and inside `crate::{...}`), modules or not.
fn named_after_crate(code: &str) -> BTreeSet<String> {
    named_after(code, "crate::")
}

/// The names right after each `prefix` (a path such as `super::`, not preceded by another path
/// segment, and inside `prefix{...}`), whether in a `use` line or inline.
fn named_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().last();
        rest = &rest[at + prefix.len()..];
        // `$crate::` in macros, paths like `tllm_affinity_core::` and `a::super::` (never
        // written, but not this prefix) are not the path asked for.
        if matches!(before, Some(c) if c.is_ascii_alphanumeric() || c == '_' || c == '$' || c == ':')
        {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && (c.is_ascii_alphabetic() || c == '_') => {
                        names.insert(ident_at(&group[i..]).to_string());
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            names.insert(ident_at(rest).to_string());
        }
    }
    names
}

/// The files named `*.<extension>` under `dir`, at any depth.
fn files_under(dir: &Path, extension: &str, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, extension, out);
        } else if path.extension().is_some_and(|e| e == extension) {
            out.push(path);
        }
    }
}

/// A folder of modules: a directory whose `mod.rs` only declares its files, each a module of the
/// crate's graph (`host::topology`), as the registry and the engine are not (their `mod.rs` holds
/// code, so each is one module).
fn is_folder_of_modules(src: &Path, name: &str) -> bool {
    let Ok(face) = fs::read_to_string(src.join(name).join("mod.rs")) else {
        return false;
    };
    code_of(&face).lines().all(|line| {
        let line = line.trim();
        line.is_empty() || line.starts_with("#[") || line.starts_with("pub mod ")
    })
}

/// The crate's modules: the top-level ones `lib.rs` declares, with each folder of modules
/// replaced by its files (`host::topology`), each with the text of all its files.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    for (name, text) in modules_declared_in(src, "lib.rs") {
        if is_folder_of_modules(src, &name) {
            for (file, text) in modules_declared_in(&src.join(&name), "mod.rs") {
                found.insert(format!("{name}::{file}"), text);
            }
        } else {
            found.insert(name, text);
        }
    }
    found
}

/// The layer `module` sits in: its folder, or "" for a leaf at the root.
fn folder_of(module: &str) -> &str {
    match module.split_once("::") {
        Some((folder, _)) => folder,
        None if module == "registry" || module == "engine" => module,
        None => "",
    }
}

/// The top-level modules the crate root `root` (`lib.rs`, `main.rs`) declares in files of their
/// own, each with the text of all its files.
fn modules_declared_in(src: &Path, root: &str) -> BTreeMap<String, String> {
    let lib = fs::read_to_string(src.join(root)).unwrap_or_else(|e| panic!("{root}: {e}"));
    let mut found = BTreeMap::new();
    for line in lib.lines() {
        let Some(name) = line
            .trim()
            .strip_prefix("pub mod ")
            .or(line.trim().strip_prefix("mod "))
            .filter(|declared| declared.ends_with(';'))
        else {
            continue;
        };
        let name = name.trim_end_matches(';').to_string();
        let mut files = Vec::new();
        let file = src.join(format!("{name}.rs"));
        if file.exists() {
            files.push(file);
        }
        if src.join(&name).is_dir() {
            files_under(&src.join(&name), "rs", &mut files);
        }
        assert!(
            !files.is_empty(),
            "{root} declares {name}, which has no file"
        );
        let text = files
            .iter()
            .map(|f| fs::read_to_string(f).unwrap())
            .collect::<Vec<_>>()
            .join("\n");
        found.insert(name, text);
    }
    assert!(!found.is_empty(), "no module declared in {}", src.display());
    found
}

fn graph(modules: &BTreeMap<String, String>) -> Graph {
    modules
        .iter()
        .map(|(name, text)| {
            let code = without_test_items(&code_of(text));
            let mut named = BTreeSet::new();
            for first in named_after_crate(&code) {
                if modules.contains_key(&first) {
                    named.insert(first);
                } else {
                    // A folder: the file after it, `crate::host::topology`.
                    for file in named_after(&code, &format!("crate::{first}::")) {
                        named.insert(format!("{first}::{file}"));
                    }
                }
            }
            if let Some((folder, _)) = name.split_once("::") {
                for file in named_after(&code, "super::") {
                    named.insert(format!("{folder}::{file}"));
                }
            }
            let deps = named
                .into_iter()
                .filter(|d| d != name && modules.contains_key(d))
                .collect();
            (name.clone(), deps)
        })
        .collect()
}

/// A cycle of modules, if the graph has one, as the path that closes it (`a -> b -> a`).
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|start| visit(start, graph, &mut Vec::new(), &mut done))
}

/// The engine's files (`src/engine/*.rs` but `mod.rs`), each with the other files it names, and
/// each way a file names the engine's face instead of a file.
fn engine_graph(engine: &Path) -> (Graph, Vec<String>) {
    let mut texts = BTreeMap::new();
    for entry in fs::read_dir(engine).unwrap_or_else(|e| panic!("{}: {e}", engine.display())) {
        let path = entry.unwrap().path();
        let Some(name) = path.file_stem().and_then(|n| n.to_str()) else {
            continue;
        };
        if path.extension().is_some_and(|e| e == "rs") && name != "mod" {
            let text = fs::read_to_string(&path).unwrap();
            // From a file of the engine, `super::super::` is the crate: no file of the engine.
            let code = without_test_items(&code_of(&text)).replace("super::super::", "crate::");
            texts.insert(name.to_string(), code);
        }
    }
    let mut refused = Vec::new();
    let graph = texts
        .iter()
        .map(|(name, code)| {
            let mut deps = BTreeSet::new();
            for named in named_after(code, "super::") {
                if texts.contains_key(&named) {
                    deps.insert(named);
                } else {
                    refused.push(format!(
                        "engine/{name}.rs names super::{named}, which is no file of the engine: name it by its home"
                    ));
                }
            }
            deps.extend(
                named_after(code, "crate::engine::")
                    .into_iter()
                    .filter(|n| texts.contains_key(n)),
            );
            deps.remove(name);
            (name.clone(), deps)
        })
        .collect();
    if let Ok(face) = fs::read_to_string(engine.join("mod.rs")) {
        let code = code_of(&face);
        for word in ["fn ", "static ", "struct ", "enum ", "const ", "impl "] {
            if code.contains(word) {
                refused.push(format!(
                    "engine/mod.rs defines something ({}): it only names the files and hands on the C ABI",
                    word.trim()
                ));
            }
        }
    }
    (graph, refused)
}

/// Each way the sources at `src` break the layers, as one line; `layers` lists the folders
/// bottom first ("" for the leaves at the root).
fn violations(src: &Path, layers: &[&str]) -> Vec<String> {
    let modules = modules(src);
    let graph = graph(&modules);
    let mut found = Vec::new();
    if src.join("engine").is_dir() {
        let (engine, refused) = engine_graph(&src.join("engine"));
        found.extend(refused);
        if let Some(cycle) = find_cycle(&engine) {
            found.push(format!("engine import cycle: {}", cycle.join(" -> ")));
        }
    }
    let layer = |module: &str| layers.iter().position(|l| *l == folder_of(module));
    for (module, deps) in &graph {
        let Some(mine) = layer(module) else {
            found.push(format!("{module} is in no layer"));
            continue;
        };
        for dep in deps {
            if layer(dep).is_some_and(|theirs| theirs > mine) {
                found.push(format!(
                    "{module} names crate::{dep}, a layer above it ({})",
                    folder_of(dep)
                ));
            }
        }
    }
    if let Some(cycle) = find_cycle(&graph) {
        found.push(format!("import cycle: {}", cycle.join(" -> ")));
    }
    let lib = fs::read_to_string(src.join("lib.rs")).unwrap();
    if !lib.contains("#![deny(unsafe_code)]") {
        found.push("lib.rs does not deny unsafe_code".into());
    }
    // `allow(unsafe_code)` only where a listed module is declared: in lib.rs, or a folder's mod.rs.
    let mut declaring = vec![(String::new(), "lib.rs".to_string())];
    for folder in layers.iter().filter(|f| is_folder_of_modules(src, f)) {
        declaring.push((format!("{folder}::"), format!("{folder}/mod.rs")));
    }
    for (prefix, file) in &declaring {
        let text = fs::read_to_string(src.join(file)).unwrap_or_default();
        let mut lines = text.lines().peekable();
        while let Some(line) = lines.next() {
            if line.trim() == "#[allow(unsafe_code)]" {
                let next = lines.peek().map(|l| l.trim()).unwrap_or("");
                let module = next
                    .strip_prefix("pub mod ")
                    .unwrap_or(next)
                    .trim_end_matches(';');
                let module = format!("{prefix}{module}");
                if !UNSAFE_ALLOWED.contains(&module.as_str()) {
                    found.push(format!("{file} allows unsafe_code on {module}"));
                }
            }
        }
    }
    let mut files = Vec::new();
    files_under(src, "rs", &mut files);
    for file in &files {
        let relative = file
            .strip_prefix(src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if declaring.iter().any(|(_, declares)| *declares == relative) {
            continue;
        }
        let text = code_of(&fs::read_to_string(file).unwrap());
        if text.contains("allow(unsafe_code)") {
            found.push(format!("{} allows unsafe_code itself", file.display()));
        }
    }
    found
}

#[test]
fn the_layers_hold_in_this_crates_sources() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = violations(&src, &LAYERS);
    assert!(
        found.is_empty(),
        "the layers are broken:\n{}",
        found.join("\n")
    );
    // The modules this test was written for are still there to check.
    let modules = modules(&src);
    for expected in [
        "engine",
        "sys",
        "identity",
        "placement::load_facts",
        "host::topology",
        "registry",
    ] {
        assert!(
            modules.contains_key(expected),
            "{expected} not found in lib.rs"
        );
    }
    // The engine's order is read, not assumed: api calls init, and init never calls back.
    let (engine, _) = engine_graph(&src.join("engine"));
    assert!(engine["api"].contains("init"), "{engine:#?}");
    assert!(!engine["init"].contains("api"), "{engine:#?}");
    assert!(engine["fork"].contains("state"), "{engine:#?}");
}

/// The CLI is a crate of its own (`cli/`): the compiler keeps the core from naming it; this keeps
/// it from reaching into the engine or allowing `unsafe` (its raw calls go through `sys`).
#[test]
fn the_cli_crate_names_the_core_not_the_engine_and_allows_no_unsafe() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("cli/src");
    let mut files = Vec::new();
    files_under(&src, "rs", &mut files);
    assert!(files.len() > 3, "{files:?}");
    let mut found = Vec::new();
    for file in &files {
        let code = code_of(&fs::read_to_string(file).unwrap());
        if code.contains("tllm_affinity_core::engine") {
            found.push(format!("{} names the engine", file.display()));
        }
        if code.contains("allow(unsafe_code)") || code.contains("unsafe {") {
            found.push(format!("{} uses unsafe", file.display()));
        }
    }
    let main = fs::read_to_string(src.join("main.rs")).unwrap();
    if !main.contains("#![deny(unsafe_code)]") {
        found.push("cli/src/main.rs does not deny unsafe_code".into());
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The CLI's modules name each other without a cycle: what two subcommands share (the drawing,
/// the reading of a process) lives in a module both name, never in one of them.
#[test]
fn the_cli_modules_name_each_other_without_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("cli/src");
    let graph = graph(&modules_declared_in(&src, "main.rs"));
    if let Some(cycle) = find_cycle(&graph) {
        panic!("CLI import cycle: {}\n{graph:#?}", cycle.join(" -> "));
    }
    // The arrows this test was written for are read, not assumed.
    assert!(graph["host"].contains("ps"), "{graph:#?}");
    assert!(graph["ps"].contains("draw"), "{graph:#?}");
}

/// A Python module's name from its path under the package root: `a/b.py` is `a.b`, a package's
/// `a/__init__.py` is `a`.
fn python_module_name(relative: &Path) -> String {
    let mut parts: Vec<String> = relative
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "__init__") {
        parts.pop();
    }
    parts.join(".")
}

/// Python code without its comments and triple-quoted strings (docstrings show imports as
/// examples; they import nothing).
fn python_code_of(text: &str) -> String {
    let mut code = String::new();
    let mut rest = text;
    loop {
        let next = ["\"\"\"", "'''"]
            .iter()
            .filter_map(|q| rest.find(q).map(|at| (at, *q)))
            .min();
        let Some((at, quote)) = next else {
            code.push_str(rest);
            break;
        };
        code.push_str(&rest[..at]);
        let after = &rest[at + 3..];
        rest = after.find(quote).map_or("", |end| &after[end + 3..]);
    }
    code.lines()
        .map(|line| line.split('#').next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules of the Python sources under `root` (every `.py` file), each with the modules of
/// the same sources it imports, at the top or inside a function: `import a.b`, `from a import
/// b` (the module `a.b` when there is one, else `a`) and the relative `from .b import c`.
fn python_graph(root: &Path) -> Graph {
    let mut files = Vec::new();
    files_under(root, "py", &mut files);
    let texts: BTreeMap<String, (bool, String)> = files
        .iter()
        .map(|f| {
            let relative = f.strip_prefix(root).unwrap();
            let is_package = f.ends_with("__init__.py");
            let text = python_code_of(&fs::read_to_string(f).unwrap());
            (python_module_name(relative), (is_package, text))
        })
        .collect();
    // The known module a dotted name stands for: itself, else its longest known prefix.
    let known = |dotted: &str| -> Option<String> {
        let mut name = dotted.to_string();
        loop {
            if texts.contains_key(&name) {
                return Some(name);
            }
            name.truncate(name.rfind('.')?);
        }
    };
    texts
        .iter()
        .map(|(module, (is_package, code))| {
            let mut deps = BTreeSet::new();
            // Joined lines: `from a import (b,\n c)` is one statement.
            let code = code.replace("(\n", "(").replace(",\n", ",");
            for line in code.lines().map(str::trim) {
                if let Some(names) = line.strip_prefix("import ") {
                    for name in names.split(',') {
                        let name = name.split_whitespace().next().unwrap_or("");
                        deps.extend(known(name));
                    }
                } else if let Some(rest) = line.strip_prefix("from ") {
                    let Some((from, names)) = rest.split_once(" import ") else {
                        continue;
                    };
                    let dots = from.len() - from.trim_start_matches('.').len();
                    let from = if dots == 0 {
                        from.to_string()
                    } else {
                        // `.` is this module's package (the module itself when it is one).
                        let mut base: Vec<&str> = module.split('.').collect();
                        let up = dots - usize::from(*is_package);
                        base.truncate(base.len().saturating_sub(up));
                        let tail = from.trim_start_matches('.');
                        base.extend((!tail.is_empty()).then_some(tail));
                        base.join(".")
                    };
                    let names = names.trim_matches(|c| c == '(' || c == ')' || c == ' ');
                    for name in names.split(',') {
                        let name = name.split_whitespace().next().unwrap_or("");
                        deps.extend(known(&format!("{from}.{name}")));
                    }
                }
            }
            deps.remove(module);
            (module.clone(), deps)
        })
        .collect()
}

/// The Python package and its start-up hook (`python/`) import round no cycle.
#[test]
fn the_python_modules_import_each_other_without_a_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let graph = python_graph(&root);
    if let Some(cycle) = find_cycle(&graph) {
        panic!("Python import cycle: {}\n{graph:#?}", cycle.join(" -> "));
    }
    // The imports this test was written for are read, not assumed.
    assert!(
        graph["_tllm_affinity_hook"].contains("tllm_affinity.adapters.trtllm"),
        "{graph:#?}"
    );
    assert!(
        graph["tllm_affinity.adapters.trtllm"].contains("tllm_affinity"),
        "{graph:#?}"
    );
}

/// The Python reading finds a cycle through each way of importing, and none in a docstring.
#[test]
fn the_python_check_names_a_cycle() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    };
    write("pkg/__init__.py", "from .sub import thing\n");
    write("pkg/sub/__init__.py", "");
    write(
        "pkg/sub/thing.py",
        "def f():\n    from .. import other  # lazy, still an arrow\n",
    );
    write(
        "pkg/other.py",
        "\"\"\"\nimport pkg.sub.thing\n\"\"\"\nimport os, pkg.sub as s\n",
    );
    write("top.py", "import pkg.other\n");
    let graph = python_graph(dir.path());
    assert_eq!(graph["pkg"], BTreeSet::from(["pkg.sub.thing".to_string()]));
    assert_eq!(
        graph["pkg.sub.thing"],
        BTreeSet::from(["pkg.other".to_string()])
    );
    assert_eq!(graph["pkg.other"], BTreeSet::from(["pkg.sub".to_string()]));
    assert!(find_cycle(&graph).is_none(), "{graph:#?}");
    write("pkg/sub/__init__.py", "from pkg import other as o\n");
    let graph = python_graph(dir.path());
    let cycle = find_cycle(&graph).expect("a cycle");
    assert_eq!(cycle.first(), cycle.last(), "{cycle:?}");
    assert!(cycle.contains(&"pkg.sub".to_string()), "{cycle:?}");
}

#[test]
fn the_check_names_each_kind_of_break() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    let write = |name: &str, text: &str| {
        let path = src.join(name);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    };
    write(
        "lib.rs",
        "#![deny(unsafe_code)]\npub mod a;\npub mod b;\npub mod c;\n#[allow(unsafe_code)]\npub mod d;\npub mod e;\npub mod engine;\n",
    );
    // A cycle through a brace group, leaves naming the engine and a folder's file naming a folder
    // above it, unsafe allowed on modules outside the list (in lib.rs and a folder's mod.rs) and
    // inside a file.
    write("a.rs", "use crate::{b::Thing, log_debug};\n");
    write("b.rs", "use crate::a;\nfn f() { crate::engine::go() }\n");
    write(
        "engine/mod.rs",
        "pub mod inner;\n// crate::d in a comment is no dependency\nstatic S: u8 = 0;\n",
    );
    write(
        "engine/inner.rs",
        "#![allow(unsafe_code)]\nuse crate::c::kept;\n",
    );
    write("d/mod.rs", "//! A folder.\n\npub mod deep;\n");
    write("e/mod.rs", "#[allow(unsafe_code)]\npub mod up;\n");
    write("e/up.rs", "use crate::a;\n");
    // Inside the engine: a cycle through an inline `super::` path and a `crate::engine::` group,
    // a name taken through the face, and a face that defines something.
    write(
        "engine/first.rs",
        "fn f() { super::second::go() }\nuse super::super::c;\n",
    );
    write(
        "engine/second.rs",
        "use crate::engine::{first::x, third};\nfn g() { super::lock_registry() }\n",
    );
    write("engine/third.rs", "use self::nested::y;\nmod nested {}\n");
    write(
        "d/deep.rs",
        "use crate::engine;\nfn f() { crate::e::up::go() }\n",
    );
    // Test-only items name what they like: none of these counts.
    write(
        "c.rs",
        "#[cfg(test)]\nuse crate::engine;\n#[cfg(test)]\nmod tests {\n    fn f() { crate::engine::go(\"{}\") }\n}\npub fn kept() {}\n",
    );
    let found = violations(src, &["", "d", "e", "engine"]);
    let expect = [
        "b names crate::engine, a layer above it (engine)",
        "d::deep names crate::engine, a layer above it (engine)",
        "d::deep names crate::e::up, a layer above it (e)",
        "import cycle: a -> b -> a",
        "engine import cycle: first -> second -> first",
        "engine/second.rs names super::lock_registry",
        "engine/mod.rs defines something (static)",
        "lib.rs allows unsafe_code on d",
        "e/mod.rs allows unsafe_code on e::up",
        "allows unsafe_code itself",
    ];
    for line in expect {
        assert!(
            found.iter().any(|f| f.contains(line)),
            "missing {line:?} in {found:#?}"
        );
    }
    assert_eq!(found.len(), expect.len(), "{found:#?}");
}

/// Every folder of the core opens its `mod.rs` with a paragraph saying what it owns and what it
/// may use, and docs/design.md's map names every folder; `src/`'s root keeps at most eight files.
#[test]
fn every_folder_says_what_it_owns_and_the_design_maps_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let design = fs::read_to_string(root.join("docs/design.md")).unwrap();
    let mut missing = Vec::new();
    for folder in LAYERS.iter().filter(|f| !f.is_empty()) {
        let face = fs::read_to_string(src.join(folder).join("mod.rs"))
            .unwrap_or_else(|e| panic!("src/{folder}/mod.rs: {e}"));
        let opening: Vec<&str> = face.lines().take_while(|l| l.starts_with("//!")).collect();
        if opening.len() < 2 {
            missing.push(format!("src/{folder}/mod.rs opens with no paragraph"));
        }
        if !design.contains(&format!("`src/{folder}/`")) {
            missing.push(format!(
                "docs/design.md's map does not name `src/{folder}/`"
            ));
        }
    }
    let root_files: Vec<String> = fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    if root_files.len() > 8 {
        missing.push(format!(
            "src/ holds {} files at its root: {root_files:?}",
            root_files.len()
        ));
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// What only the CLI and the tests need stays out of the preload library's dependency graph: no
/// clap, and the core without its `simulated` feature (cargo's own answer, not the manifests').
#[test]
fn the_preload_library_depends_on_neither_clap_nor_the_simulated_hosts() {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "tree",
            "-p",
            "tllm-affinity-preload",
            "-e",
            "normal,features",
        ])
        .args(["--prefix", "none", "--offline"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(tree.contains("tllm-affinity-core v"), "{tree}");
    let unwanted: Vec<&str> = tree
        .lines()
        .filter(|l| l.starts_with("clap") || l.contains("feature \"simulated\""))
        .collect();
    assert!(unwanted.is_empty(), "{unwanted:#?}");
}

/// The floors of docs/design.md's engine table: each engine file the table names, with its
/// floor (rows `| <floor> | `file.rs`, ... | concern |`).
fn documented_floors(design: &str) -> BTreeMap<String, u32> {
    let mut floors = BTreeMap::new();
    for line in design.lines() {
        let mut cells = line.split('|').map(str::trim).skip(1);
        let (Some(floor), Some(files)) = (cells.next(), cells.next()) else {
            continue;
        };
        let Ok(floor) = floor.parse::<u32>() else {
            continue;
        };
        for file in files.split(',') {
            let name = file.trim().trim_matches('`');
            if let Some(stem) = name.strip_suffix(".rs") {
                floors.insert(stem.to_string(), floor);
            }
        }
    }
    floors
}

/// docs/design.md's floor table is the engine as it is: every file of `src/engine/` is in it
/// once, the table names no file that is gone, and each file names only files on lower floors.
#[test]
fn the_design_documents_every_engine_file_on_its_floor() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let design = fs::read_to_string(root.join("docs/design.md")).unwrap();
    let floors = documented_floors(&design);
    let (engine, _) = engine_graph(&root.join("src/engine"));
    let files: BTreeSet<&String> = engine.keys().collect();
    let documented: BTreeSet<&String> = floors.keys().collect();
    assert_eq!(
        files.difference(&documented).collect::<Vec<_>>(),
        Vec::<&&String>::new(),
        "engine files missing from docs/design.md's floor table"
    );
    assert_eq!(
        documented.difference(&files).collect::<Vec<_>>(),
        Vec::<&&String>::new(),
        "docs/design.md's floor table names files the engine no longer has"
    );
    let mut upward = Vec::new();
    for (file, deps) in &engine {
        for dep in deps {
            if floors[dep] >= floors[file] {
                upward.push(format!(
                    "{file}.rs (floor {}) names {dep}.rs (floor {})",
                    floors[file], floors[dep]
                ));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "docs/design.md's floors do not match the code:\n{}",
        upward.join("\n")
    );
}
