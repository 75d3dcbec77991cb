//! Volfile text for tests that build a client stack by hand: layers written the way kilnd
//! writes them.

/// A `protocol-client` layer named `name`, connected to `remote` (`unix:PATH` or
/// `HOST:PORT`).
pub fn client(name: &str, remote: &str) -> String {
    format!("\n[[layer]]\nname = \"{name}\"\ntype = \"protocol-client\"\nremote = \"{remote}\"\n")
}

/// `io-stats` named `top` over `distribute` (`top-dist`) over one protocol-client per
/// remote (`top-b0`, `top-b1`, …).
pub fn distribute(top: &str, remotes: &[String]) -> String {
    let names: Vec<String> = (0..remotes.len())
        .map(|i| format!("\"{top}-b{i}\""))
        .collect();
    let mut v = format!(
        "[[layer]]\nname = \"{top}\"\ntype = \"io-stats\"\n\n\
         [[layer]]\nname = \"{top}-dist\"\ntype = \"distribute\"\nsubvolumes = [{}]\n",
        names.join(", ")
    );
    for (i, r) in remotes.iter().enumerate() {
        v.push_str(&client(&format!("{top}-b{i}"), r));
    }
    v
}
