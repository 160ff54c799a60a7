#!/usr/bin/env bash
# Malformed-input corpus (issue 11 §5): every item must exit 2 with exactly
# one line on stderr, of printable ASCII and at most 1000 characters, that
# contains the fragment the item expects. Files are tests/bad_inputs/*.yaml;
# what cannot live in a text file (NUL and control bytes, megabyte values,
# deep nesting, oversized files) is generated here.
# Usage: bad_input_corpus.sh MOEVERIFY SOURCE_DIR
set -u
bin=$1
src=$2
dir=$src/tests/bad_inputs
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0

# item NAME FRAGMENT ARGS...: runs moeverify ARGS and checks the contract.
item() {
  local name=$1 frag=$2
  shift 2
  timeout 60 "$bin" "$@" >"$tmp/out" 2>"$tmp/err" </dev/null
  local rc=$? lines chars why=""
  lines=$(wc -l <"$tmp/err")
  chars=$(wc -c <"$tmp/err")
  if [ "$rc" != 2 ]; then
    why="exit $rc, expected 2"
  elif [ "$lines" != 1 ] || [ "$(tail -c 1 "$tmp/err" | od -An -c | tr -d ' ')" != '\n' ]; then
    why="$lines line(s) on stderr, expected exactly one"
  elif [ "$chars" -gt 1000 ]; then
    why="the line has $chars characters, more than 1000"
  elif LC_ALL=C grep -q '[^[:print:]]' "$tmp/err"; then
    why="the line has non-printable bytes"
  elif ! grep -qF -- "$frag" "$tmp/err"; then
    why="the line lacks '$frag'"
  fi
  if [ -z "$why" ]; then
    echo "ok   $name: $(head -c 200 "$tmp/err")"
    passed=$((passed + 1))
  else
    echo "FAIL $name: $why"
    head -c 600 "$tmp/err" | cat -v
    echo
    failed=$((failed + 1))
  fi
}

v() { item "$1" "$2" validate "$dir/$1.yaml"; }  # a corpus file, with its expected fragment
ok_file=$dir/valid_small.yaml
basic=$src/cases/basic.yaml

# --- exit 3 before: complex keys, a folder, --set syntax, output paths -------
v complex_key_top "complex_key_top.yaml:1:3: key: expected a plain key"
v complex_key_sweep "complex_key_sweep.yaml:3:15: sweep: expected a plain key"
v complex_key_case "complex YAML key"
v merge_key "merge_key.yaml:5:5: key: a YAML merge key (<<: *anchor), which case files do not expand"
item folder_as_case_file "is a folder, not a case file" run "$dir"
# the wrong shape of cases or defaults is named as such (they once read
# "cases: missing or empty" and "case: expected a mapping")
v cases_a_mapping "cases_a_mapping.yaml:1:8: cases: a mapping, not a list"
v name_not_utf8 "name_not_utf8.yaml:2:11: name: the name 'a\\xff\\xfe' is not valid UTF-8 text"
v defaults_a_scalar "defaults_a_scalar.yaml:1:11: defaults: expected a mapping of case keys, got '5'"
item check_no_folder "$tmp/nonexist: no such folder" check "$tmp/nonexist"
item set_unclosed_list "--set shape.tokens: YAML syntax error" validate "$ok_file" --set 'shape.tokens=[1,'
item set_unclosed_map "--set dtype: YAML syntax error" validate "$ok_file" --set 'dtype={'
touch "$tmp/a_file"
item json_missing_folder "the folder $tmp/missing does not exist" run "$ok_file" --json "$tmp/missing/r.json"
item json_under_a_file "Not a directory" run "$ok_file" --json "$tmp/a_file/r.json"
item json_is_a_folder "--json $tmp: is a folder" run "$ok_file" --json "$tmp"
item json_new_file_in_proc "proc file system" run "$ok_file" --json /proc/moev-report.json
item dump_missing_folder "the folder $tmp/missing does not exist" run "$ok_file" --dump "$tmp/missing/d"
item dump_is_a_file "exists and is a file" run "$ok_file" --dump "$tmp/a_file"
item dump_under_a_file "Not a directory" run "$ok_file" --dump "$tmp/a_file/d"
item dump_in_proc "proc file system" run "$ok_file" --dump /proc/moev-dump
item dump_in_sys "sysfs file system" run "$ok_file" --dump /sys/moev-dump
item dump_is_a_device "exists and is a character device" run "$ok_file" --dump /dev/null

# --- exit 0 before: duplicates, documents, empty and odd option values -------
v duplicate_key_case "duplicate_key_case.yaml:4:5: dtype: duplicate key (first at line 3)"
v duplicate_key_nested "shape.tokens: duplicate key"
v duplicate_dotted_nested "shape.tokens: set twice in one mapping (also at"
v duplicate_section "shape: duplicate key"
v duplicate_cases "duplicate_cases.yaml:3:1: cases: duplicate key"
v duplicate_defaults_key "seed: duplicate key"
v duplicate_sweep_key "sweep.dtype: duplicate key"
v sweep_and_fixed "sweep.dtype: the case also sets dtype at"
v second_document "second_document.yaml:4:1: a second YAML document"
v second_document_after_end "a second YAML document"
item case_empty_name "--case: the name is empty" run "$ok_file" --case ''
item collective_timeout_nan "--collective-timeout: expected a finite number, got 'nan'" run "$ok_file" --collective-timeout nan
item collective_timeout_inf "--collective-timeout: expected a finite number, got 'inf'" run "$ok_file" --collective-timeout inf
item collective_timeout_zero "--collective-timeout: 0 is out of range" run "$ok_file" --collective-timeout 0
item json_dev_full "--json /dev/full: is a character device" run "$ok_file" --json /dev/full
item json_proc_version "--json /proc/version: lies on the kernel's proc file system" run "$ok_file" --json /proc/version
item json_empty "--json: the path is empty" run "$ok_file" --json ''
item dump_empty "--dump: the path is empty" run "$ok_file" --dump ''
item set_twice "--set dtype: given twice" validate "$ok_file" --set dtype=bf16 --set dtype=fp16

# --- vague messages before ----------------------------------------------------
python3 -c "print('cases:\n  - name: a\n    shape: ' + '[' * 3000 + ']' * 3000)" >"$tmp/deep.yaml"
item deep_nesting "levels deep, the parser's limit" validate "$tmp/deep.yaml"
printf 'cases:\n  - name: a\n    dtype: fp\0003\n' >"$tmp/nul_value.yaml"
item nul_in_value "nul_value.yaml:3:14: control byte \\x00" validate "$tmp/nul_value.yaml"
printf 'cases:\n  - name: a\n    dt\000ype: fp32\n' >"$tmp/nul_key.yaml"
item nul_in_key "nul_key.yaml:3:7: control byte \\x00" validate "$tmp/nul_key.yaml"
printf 'cases:\n  - name: a\n    dtype: fp\00132\n' >"$tmp/ctrl.yaml"
item control_byte "ctrl.yaml:3:14: control byte \\x01" validate "$tmp/ctrl.yaml"
printf 'cases:\n  - name: a\n    dtype: \033[31mred\n' >"$tmp/esc.yaml"
item terminal_escape "control byte \\x1b" validate "$tmp/esc.yaml"
item set_control_byte "--set dtype (column 3 of the value): control byte \\x07" validate "$ok_file" --set "dtype=fp$(printf '\007')32"
python3 -c "print('cases:\n  - name: a\n    dtype: ' + 'x' * (1 << 20))" >"$tmp/mib_value.yaml"
item mib_value "dtype: unknown value 'xxxxxxxx" validate "$tmp/mib_value.yaml"
python3 -c "print('cases:\n  - name: a\n    ' + 'k' * 1000 + ': 1')" >"$tmp/long_key.yaml"
item long_key "kkkkkkkk...: unknown key" validate "$tmp/long_key.yaml"
python3 -c "print('cases:\n  - name: a\n    ' + 'k' * (1 << 20) + ': 1')" >"$tmp/mib_key.yaml"
item mib_key "mib_key.yaml:3:1048581: YAML syntax error" validate "$tmp/mib_key.yaml"
python3 -c "print('cases:\n  - name: ' + 'n' * (1 << 20))" >"$tmp/mib_name.yaml"
item mib_name "name: the name has 1048576 characters; valid: at most 200" validate "$tmp/mib_name.yaml"
item set_mib_value "unknown value 'vvvvvvvv" validate "$ok_file" --set "dtype=$(python3 -c "print('v' * 100000)")"
item set_invalid_utf8 "unknown value 'fp32\\xff'" validate "$ok_file" --set "dtype=fp32$(printf '\377')"
v unclosed_double_quote "unclosed_double_quote.yaml:3:12: unclosed quote"
v unclosed_single_quote_swallows "unclosed_single_quote_swallows.yaml:2:11: unclosed quote"
item set_unclosed_quote "--set dtype (column 6 of the value): unclosed quote: the text ends inside a quoted string" validate "$ok_file" --set 'dtype="fp32'
item unknown_command "unknown command 'frobnicate'" frobnicate "$ok_file"
item no_command "no command given"
item threads_not_a_number "--threads: expected an integer, got 'abc'; valid: an integer in [1, 256]" run "$ok_file" --threads abc
item threads_zero "--threads: 0 is out of range" run "$ok_file" --threads 0
item threads_float "--threads: expected an integer, got '1e3'" run "$ok_file" --threads 1e3
item unknown_option "--frob" run "$ok_file" --frob

# --- memory: estimated before anything is allocated -------------------------
v huge_tokens_hidden "case 'huge': estimated peak memory"
item huge_tokens_hidden_limit "exceeds the limit 1.0 GiB (--max-memory 1G)" run "$dir/huge_tokens_hidden.yaml" --max-memory 1G
item align_4096 "case 'wide_align': estimated peak memory" run "$dir/align_4096.yaml" --max-memory 4G
item ep256_swiglu "case 'ep256': estimated peak memory" run "$dir/ep256_swiglu.yaml" --max-memory 1G
item set_tokens_over_limit "exceeds the limit 64.0 MiB" run "$ok_file" --set shape.tokens=1000000 --max-memory 64M
item validate_over_limit "exceeds the limit 512.0 KiB" validate "$ok_file" --max-memory 512K
v huge_sweep "huge_sweep.yaml:4:5: sweep: expands the file to more than 10000 cases"
python3 - "$tmp/many.yaml" <<'PY'
import sys
vals = ", ".join(str(i) for i in range(6000))
open(sys.argv[1], "w").write(f"cases:\n  - name: a\n    sweep: {{seed: [{vals}]}}\n  - name: b\n    sweep: {{seed: [{vals}]}}\n")
PY
item sweeps_over_file_cap "many.yaml:5:5: sweep: expands the file to more than 10000 cases" validate "$tmp/many.yaml"
item max_memory_garbage "--max-memory: expected a size, got 'lots'" run "$ok_file" --max-memory lots
item max_memory_zero "--max-memory: the size '0' is below one byte" run "$ok_file" --max-memory 0
item max_memory_unit "--max-memory: unknown unit 'X'" run "$ok_file" --max-memory 12X
item max_memory_negative "--max-memory: expected a size, got '-5G'" run "$ok_file" --max-memory -5G
item max_memory_two_dots "--max-memory: expected a size, got '1.2.3G'" run "$ok_file" --max-memory 1.2.3G
item max_memory_empty "--max-memory: expected a size, got ''" validate "$ok_file" --max-memory ''

# --- the rest of the contract ---------------------------------------------------
v empty "empty.yaml: file: the case file is empty"
v only_comment "the case file is empty"
item dev_null_case_file "the case file is empty" validate /dev/null
v top_level_list "top_level_list.yaml:1:1: file: expected a mapping at the top"
v unknown_top_key "unknown_top_key.yaml:1:1: case: unknown top-level key"
v no_cases "cases: missing or empty"
v unknown_case_key "unknown_case_key.yaml:3:25: shape.topk: unknown key (did you mean top_k?)"
v sweep_misspelt "sweep_misspelt.yaml:4:5: sweeep: unknown key (did you mean sweep?); valid keys here: align,"
v out_of_range "shape.tokens: value -1 is out of range"
v duplicate_name_after_sweep "duplicate case name 'a[seed=1]'"
v name_with_newline "the name 'a\\x0ab' contains a control character"
v tokens_per_rank_length "has 3 entries for ep 2"
# sequence parallel (docs/contract.md §10)
v sp_zero "sp_zero.yaml:3:9: sp: value 0 is out of range"
v sp_virtual_batch_uneven "sp_virtual_batch_uneven.yaml:4:32: shape.seq_len: virtual SP padding with batch 2 needs seq_len % sp == 0"
v sp_seq_len_tokens_disagree "shape.tokens: 9 disagrees with batch * seq_len = 8"
v sp_padding_unknown "sp_padding: unknown value 'front'; valid: virtual | tail"
v backward_unknown "backward: unknown value 'yes please'; valid: off | on"
v backend_unknown "backend_unknown.yaml:3:14: backend: unknown value 'gpu'; valid: host | cuda | emulated"
# capacity (docs/contract.md §11) and layer entries (§12)
v capacity_negative "capacity_negative.yaml:3:24: capacity.factor: value -1 is out of range; valid: a number in [0, 1000]"
v capacity_policy "capacity.policy: unknown value 'random'; valid: probs | position"
v capacity_unknown_key "capacity.min_capacity: unknown key; valid keys here: factor, pad_to_capacity, policy"
v layers_zero "layers_zero.yaml:3:13: layers: value 0 is out of range"
v batch_seq_len_past_range "shape.seq_len: batch 65536 x seq_len 65536 = 4294967296 tokens, past the token range"
python3 -c "
import sys
f = open(sys.argv[1], 'w')
f.write('cases:\n  - name: a\n')
f.write(('#' + 'c' * 1023 + '\n') * (17 * 1024))" "$tmp/big.yaml"
item file_over_16mib "the case file is larger than 16 MiB" validate "$tmp/big.yaml"
item missing_file "cannot open the case file" validate "$tmp/none.yaml"
item no_such_case "--case nope: no case of that name" run "$ok_file" --case nope
item bad_fault "--fault" run "$ok_file" --fault no_such_fault
item set_unknown_key "unknown key 'shape.tokenz' (did you mean shape.tokens?)" validate "$ok_file" --set shape.tokenz=3
item set_no_equals "--set dtype: expected key=value" validate "$ok_file" --set dtype
item validate_nothing "validate: give case files, or --keys" validate
item backend_flag "--backend: unknown backend 'gpu'; valid: host | cuda | emulated" run "$ok_file" --backend gpu
# Input once read silently otherwise (a review's finds, 2026-11-28): a token
# count beside the per-rank one, integers YAML 1.1 read as octal or hex, a
# near miss of a sweep point's name (a glob would select x2 and xe), profile
# files with an unclosed quote, a repeated key, a second document, a range
# over an enum key or past a key's range, and no end
printf 'cases:\n  - {name: a, ep: 2, shape: {tokens: 100, tokens_per_rank: [3, 5]}}\n' > "$tmp/tok2.yaml"
item tokens_beside_per_rank "shape.tokens: set beside shape.tokens_per_rank" validate "$tmp/tok2.yaml"
printf 'cases:\n  - {name: a, shape: {top_k: 010}}\n' > "$tmp/octal.yaml"
item leading_zero_not_octal "shape.top_k: top_k 10 exceeds experts 8" validate "$tmp/octal.yaml" --set shape.experts=8
printf 'cases:\n  - {name: a, seed: 0x10}\n' > "$tmp/hex.yaml"
item hex_integer "expected an integer, got '0x10'; valid: an integer in" validate "$tmp/hex.yaml"
printf 'cases:\n  - {name: x, shape: {tokens: 4}, sweep: {ep: [1, 2]}}\n  - {name: x2, shape: {tokens: 4}}\n' > "$tmp/sel.yaml"
item sweep_point_near_miss "--case x[ep = 2]: no case of that name" run "$tmp/sel.yaml" --case 'x[ep = 2]'
printf 'profile: x\nabout: "our impl\nfix:\n  dtype: bf16\n' > "$tmp/p_quote.yaml"
item profile_unclosed_quote "p_quote.yaml:2:8: unclosed quote" validate --profile "$tmp/p_quote.yaml" "$ok_file"
printf 'profile: x\nfix: {dtype: bf16}\nfix: {dtype: fp32}\n' > "$tmp/p_dup.yaml"
item profile_duplicate_key "p_dup.yaml:3:1: fix: duplicate key (first at line 2)" validate --profile "$tmp/p_dup.yaml" "$ok_file"
printf 'profile: x\nfix: {dtype: bf16}\n---\nfix: {dtype: fp32}\n' > "$tmp/p_docs.yaml"
item profile_second_document "p_docs.yaml:4:1: a second YAML document" validate --profile "$tmp/p_docs.yaml" "$ok_file"
printf 'profile: x\nallow:\n  dtype: {min: 0, max: 3}\n' > "$tmp/p_enum_range.yaml"
item profile_range_over_enum "p_enum_range.yaml:3:16: allow dtype: min 0:" validate --profile "$tmp/p_enum_range.yaml" "$ok_file"
printf 'profile: x\nallow:\n  shape.tokens: [8, -5]\n' > "$tmp/p_tokens.yaml"
item profile_bad_tokens "p_tokens.yaml:3:21: allow shape.tokens:" validate --profile "$tmp/p_tokens.yaml" "$ok_file"
item profile_endless "the profile file is larger than 1 MiB" validate --profile /dev/zero "$ok_file"
printf 'defaults: {name: x}\ncases:\n  - {name: a}\n' > "$tmp/default_name.yaml"
item defaults_name "default_name.yaml:1:18: defaults.name:" validate "$tmp/default_name.yaml"
item set_name "--set name: a case's name is its file's" validate "$ok_file" --set name=b

echo "bad-input corpus: $passed passed, $failed failed"
[ "$failed" = 0 ] && [ "$passed" -ge 60 ]
