"""The engine: how the workbook starts, runs and shows distributed programs.

- launch: torchrun from a notebook cell (live rank-prefixed output, timeout, no orphans, LaunchError)
- runtime: setup and teardown inside a launched program (backend, device, records)
- interactive: persistent ranks for %%px (notebook 01b)
- elastic: several torchrun agents on one machine, and the multi-node launch files rehearsed
- listing: a probe's own source, shown beside its result
- workbook: every notebook executed and rendered to HTML handouts (`make workbook`)
- _pxmagic, _reaper, _rootcause: private helpers of the above
"""
