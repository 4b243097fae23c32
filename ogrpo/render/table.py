"""The readable form of a Plan for `ogrpo plan` (rich tables on stdout)."""

from __future__ import annotations


def _terms(terms: dict) -> str:
    items = [(k, v) for k, v in terms.get("terms", {}).items() if v >= 0.005]
    return ", ".join(f"{k} {v:.2f}" for k, v in items)


def print_plan(plan) -> None:
    from rich.console import Console
    from rich.table import Table

    p = plan.to_dict() if hasattr(plan, "to_dict") else plan
    con = Console(highlight=False, soft_wrap=True)
    cl, m = p["cluster"], p["model"]
    unit = "process" if cl["gpu"]["is_cpu"] else "GPU"
    con.print(f"[bold]{cl['spec']}[/bold] · {m['name']} ({m['params'] / 1e9:.2f}B params, from {m['source']}) · "
              f"profile {p['profile']} · mode {p['mode']} · {p['precision']} · {p['attn_implementation']}")
    t = Table(show_header=True, header_style="bold")
    for col in ("role", "nodes", f"{unit}s", "layout", f"GiB per {unit}", "budget", "terms (GiB)"):
        t.add_column(col)
    v, tr = p["vllm"], p["trainer"]
    if p["mode"] == "server":
        mt = v["memory_terms"]
        t.add_row("vLLM server", str(v["nodes"]), str(v["gpus"]),
                  f"TP {v['tensor_parallel_size']} · DP {v['data_parallel_size']} · "
                  f"{mt.get('max_concurrent_seqs', 0)} seqs of {v['args'].get('max_model_len')} tokens fit",
                  f"{mt['total_gib']:.1f}", f"{mt['budget_gib']:.1f}", _terms(mt))
    mt = tr["memory_terms"]
    t.add_row("trainer", str(tr["nodes"]), str(tr["gpus"]) if not cl["gpu"]["is_cpu"] else f"{tr['num_processes']} procs",
              f"{tr['num_processes']} proc · {tr['strategy']}" + (" · vLLM colocated" if p["mode"] == "colocate"
                                                                     else ""),
              f"{mt['total_gib']:.1f}", f"{mt['budget_gib']:.1f}", _terms(mt))
    con.print(t)
    b = p["batch"]
    con.print(f"batch: {b['per_device_train_batch_size']} per device x {b['num_processes']} processes x "
              f"{b['steps_per_generation']} steps = generation batch {b['generation_batch_size']} "
              f"({b['prompts_per_generation']} prompts x {b['num_generations']} generations); "
              f"prompt {b['prompt_length']} + completion {b['completion_length']} tokens")
    s = Table(show_header=True, header_style="bold", title="settings")
    s.add_column("setting")
    s.add_column("value")
    s.add_column("why")
    for item in p["settings"]:
        s.add_row(item["name"], str(item["value"]), item["reason"])
    con.print(s)
    for w in p.get("warnings", []):
        con.print(f"[yellow]note:[/yellow] {w}")
    if p["fits"]:
        con.print("[bold green]fits[/bold green]")
    else:
        con.print("[bold red]does not fit[/bold red]")
        for r in p["reasons"]:
            con.print(f"  - {r}")
        if p["fixes"]:
            con.print("try: " + "; ".join(p["fixes"]))
