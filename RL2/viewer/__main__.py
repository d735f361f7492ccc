"""python -m RL2.viewer SAVE_DIR [--port N] [--html FILE]: the trajectory viewer of a PPO run."""

import argparse
import time

from RL2.viewer.export import export_html
from RL2.viewer.server import serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m RL2.viewer", description=__doc__.split(": ", 1)[1])
    parser.add_argument("save_dir", help="a PPO run's trainer.save_dir (samples.jsonl with rollout.save_samples=true)")
    parser.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (0: any free one)")
    parser.add_argument("--html", metavar="FILE", help="write one self-contained page to FILE instead of serving")
    parser.add_argument("--max-samples", type=int, help="with --html: embed only the first this many trajectories")
    args = parser.parse_args(argv)
    if args.html:
        print(f"wrote {export_html(args.save_dir, args.html, args.max_samples)}")
        return
    server = serve(args.save_dir, args.port)
    host, port = server.server_address[:2]
    print(f"RL2 viewer of {args.save_dir}: http://{host}:{port}/ (this machine only; "
          f"from another, ssh -L {port}:127.0.0.1:{port} or --html FILE). Ctrl-C stops it.", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
