"""The readable form of a Plan for `ogrpo plan` (rich tables on stdout)."""

from __future__ import annotations


def _terms(terms: dict) -> str:
    items = [(k, v) for k, v in terms.get("terms", {}).items() if v >= 0.005]
    return ", ".join(f"{k} {v:.2f}" for k, v in items)


def _count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _where(role: dict, is_cpu: bool) -> str:
    nodes = role["nodes"]
    node = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"
    if is_cpu:
        return f"{node}, {role.get('num_processes', 1)} process(es)"
    return f"{node}, GPU {','.join(map(str, role['gpus']))}"


def print_plan(plan) -> None:
    from rich.console import Console
    from rich.table import Table

    p = plan.to_dict() if hasattr(plan, "to_dict") else plan
    con = Console(highlight=False)
    cl, m = p["cluster"], p["model"]
    is_cpu = bool(cl["gpu"]["is_cpu"])
    unit = "process" if is_cpu else "GPU"
    con.print(f"[bold]{cl['spec']}[/bold] · {m['name']} ({_count(m['params'])} params, {m['source']}) · "
              f"profile {p['profile']} · mode {p['mode']} · {p['precision']} · {p['attn_implementation']}")
    t = Table(show_header=True, header_style="bold")
    t.add_column("role")
    t.add_column("where")
    t.add_column("layout")
    t.add_column(f"GiB/{unit}", justify="right")
    t.add_column("budget", justify="right")
    t.add_column("memory terms (GiB)")
    v, tr = p["vllm"], p["trainer"]
    mt = v.get("memory_terms") or {}
    if p["mode"] == "server":
        t.add_row("vLLM server", _where({**v, "num_processes": 1}, is_cpu),
                  f"TP {v['tensor_parallel_size']}, DP {v['data_parallel_size']}; "
                  f"{mt.get('max_concurrent_seqs', 0)} x {v['args'].get('max_model_len')} tokens in KV",
                  f"{mt['total_gib']:.1f}", f"{mt['budget_gib']:.1f}", _terms(mt))
    elif p["mode"] == "colocate" and mt:
        t.add_row("vLLM (colocated)", "in each trainer process",
                  f"{v['args'].get('gpu_memory_utilization')} of the device; {mt.get('max_concurrent_seqs', 0)} x "
                  f"{v['args'].get('max_model_len')} tokens in KV", f"{mt['total_gib']:.1f}",
                  f"{mt['budget_gib']:.1f}", _terms(mt))
    tt = tr["memory_terms"]
    t.add_row("trainer", _where(tr, is_cpu), f"{tr['num_processes']} x {tr['strategy']}", f"{tt['total_gib']:.1f}",
              f"{tt['budget_gib']:.1f}", _terms(tt))
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
