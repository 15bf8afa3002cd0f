"""Write a results file from one `anyccl bench` run: its command, the machine, the versions,
the nccl-tests tables as printed, and the ratios table the issue targets are judged by.

    python benchmarks/record.py OUT.md "COMMAND" run.txt run.json [notes.md]
"""

import json
import os
import platform
import sys


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}")


def main() -> None:
    out, command, text_path, json_path, *notes = sys.argv[1:]
    data = json.load(open(json_path))
    lines = [f"# {os.path.basename(out)[:-3]}", "",
             f"Command: `{command}`", "",
             f"Machine: {machine()}", "",
             f"Libraries: {', '.join(data['meta']['libraries'])}", "",
             f"Memory: one core copying 256 MiB with NumPy moves "
             f"{data['meta']['memory_copy_gbs']:.1f} GB/s (bytes read + written), same run.", ""]
    if notes:
        lines += [open(notes[0]).read().rstrip(), ""]
    lines += ["## Output, as printed", "", "```", open(text_path).read().rstrip(), "```", ""]
    with open(out, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
