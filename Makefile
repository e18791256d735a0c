# DDP Lab: `make lab` to learn, `make test` to check everything.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LAB_ARGS ?=
# Jupyter refuses to run as root unless told (containers, cloud VMs often run as root).
ROOT_ARG := $(if $(filter 0,$(shell id -u)),--allow-root)
PYTEST_ARGS ?=
# make test runs this many test files at once (pytest-xdist, a file per worker); JOBS=0: one at a time.
JOBS ?= 2
STRESS_ARGS ?=
GPU_CHECK_ARGS ?=

.PHONY: lab lab-zh zh zh-status test e2e workbook bench stress gpu-check clean

# Reinstall only when the dependency files change (or the venv is new).
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[dev]"
	@touch $(STAMP)

# Rooted at the repository (scripts/ and ddp_lab/ open from the file browser), landing on notebook 00:
# the URL Jupyter prints opens it, and so does plain /lab, through the lab's own default workspace
# (a copy of .jupyter-lab/'s, under the name JupyterLab gives "default", made once: it then keeps
# your layout; `make clean` resets it). Your own Jupyter settings and workspaces are left as they are.
# The workbook's own notebooks open trusted (their stored outputs and widgets render); yours stay as they are.
# The lab's defaults come from .jupyter-lab/settings/overrides.json (no news or update pop-up over the
# notebook; a setting you change in the lab still wins). The venv's bin/ goes first on PATH, so the
# kernels find its torchrun and ddp-lab as a terminal with the venv activated would.
LAB_WORKSPACES ?= build/lab-workspaces
LAB_SETTINGS := .jupyter-lab/settings
lab: $(STAMP)
	@$(VENV)/bin/jupyter trust notebooks/*.ipynb notebooks/solutions/*.ipynb >/dev/null
	@mkdir -p $(LAB_WORKSPACES)
	@test -e $(LAB_WORKSPACES)/default-37a8.jupyterlab-workspace || \
		cp .jupyter-lab/default-37a8.jupyterlab-workspace $(LAB_WORKSPACES)/
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/jupyter lab --ServerApp.root_dir=. $(ROOT_ARG) $(LAB_ARGS) \
		--LabApp.workspaces_dir=$(LAB_WORKSPACES) --LabApp.app_settings_dir=$(LAB_SETTINGS) \
		--LabApp.default_url=/lab/tree/notebooks/00_first_launch.ipynb

# The Chinese edition (notebooks/zh/), as `make lab` opens the English one, with JupyterLab's menus in
# Chinese: its own settings (.jupyter-lab/zh/settings: the same defaults, locale zh_CN) and workspaces,
# so `make lab` stays English. The menus need the language pack: pip install -e ".[zh]".
LAB_ZH_WORKSPACES ?= build/lab-workspaces-zh
lab-zh: $(STAMP)
	@test -e notebooks/zh/00_first_launch.ipynb || { echo "no Chinese notebooks yet: make zh"; exit 1; }
	@$(PY) -c "import jupyterlab_language_pack_zh_CN" 2>/dev/null || \
		echo "menus in English: install the Chinese language pack with $(PY) -m pip install -e '.[zh]'"
	@$(VENV)/bin/jupyter trust notebooks/zh/*.ipynb notebooks/zh/solutions/*.ipynb >/dev/null
	@mkdir -p $(LAB_ZH_WORKSPACES)
	@test -e $(LAB_ZH_WORKSPACES)/default-37a8.jupyterlab-workspace || \
		sed 's#notebooks#notebooks/zh#g' .jupyter-lab/default-37a8.jupyterlab-workspace \
		> $(LAB_ZH_WORKSPACES)/default-37a8.jupyterlab-workspace
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/jupyter lab --ServerApp.root_dir=. $(ROOT_ARG) $(LAB_ARGS) \
		--LabApp.workspaces_dir=$(LAB_ZH_WORKSPACES) --LabApp.app_settings_dir=.jupyter-lab/zh/settings \
		--LabApp.default_url=/lab/tree/notebooks/zh/00_first_launch.ipynb

# notebooks/zh/ from the English notebooks and their catalogs; refuses while a cell is untranslated
# or fuzzy (python -m ddp_lab.engine.zh build --draft previews with English left in place).
zh: $(STAMP)
	$(PY) -m ddp_lab.engine.zh build

# What needs translating: the catalogs (notebooks/zh/locale/*.po) brought in step with the English
# (new cells added, changed ones fuzzy), then each notebook's cells still to translate.
zh-status: $(STAMP)
	$(PY) -m ddp_lab.engine.zh update
	$(PY) -m ddp_lab.engine.zh status

test: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile $(PYTEST_ARGS)

# The browser tests alone: JupyterLab in headless Chromium (skipped, with the reason, without chromium).
e2e: $(STAMP)
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

# Every notebook executed top to bottom, rendered to HTML handouts in build/workbook/ (the venv's bin/
# first on PATH, as `make lab` runs them: the doctor finds its torchrun); then the Chinese edition
# rebuilt from the stored outputs and rendered, not executed, to build/workbook/zh/.
workbook: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m ddp_lab.engine.workbook build/workbook --store --workshop docs/workshop.md

bench: $(STAMP)
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_scaling.py

# Many runs in a row under load: scripts as 2-rank jobs, launching notebooks under nbval, the
# process tests of the newer paths under pytest, the browser tests (well over an hour on 2 cores).
stress: $(STAMP)
	$(PY) benchmarks/stress.py $(STRESS_ARGS)

# Every GPU path once, on a machine with CUDA (at most 8 minutes on one GPU); figures into
# docs/gpu_results.md. Without CUDA: one line, exit 0.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf build runs
