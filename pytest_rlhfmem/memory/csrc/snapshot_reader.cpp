// The compiled snapshot reader: a torch.cuda.memory._dump_snapshot() pickle read without Python's
// unpickler, for `rlhfmem replay FILE.pickle` (issue 22, "Speed and safety"; memory/snapshot_reader.py
// loads it, memory/trace.py::load_snapshot_columnar uses it).
//
// SAFETY BY CONSTRUCTION. Only the opcodes a memory snapshot is made of are read: PROTO 2-5, FRAME, STOP,
// EMPTY_DICT / EMPTY_LIST / EMPTY_TUPLE, MARK, APPEND(S), SETITEM(S), TUPLE / TUPLE1-3, (SHORT_)BINUNICODE(8),
// (SHORT_)BINBYTES(8), BININT / BININT1 / BININT2 / LONG1 / LONG4, BINFLOAT, NONE, NEWTRUE / NEWFALSE, and the
// memo (BINPUT, LONG_BINPUT, MEMOIZE, BINGET, LONG_BINGET). Every opcode that can name or call an object
// (GLOBAL, STACK_GLOBAL, INST, OBJ, REDUCE, BUILD, NEWOBJ(_EX), PERSID, BINPERSID, EXT1/2/4) is REFUSED: the
// reader stops there and nothing is ever imported or called (there is nothing here that could). Any other
// opcode, or a truncated or inconsistent stream, makes the reader DECLINE: Python then reads the same bytes
// with load_snapshot's Unpickler (which refuses every global), so such a file gets exactly today's message.
//
// WHAT COMES OUT. The trace entries of `device_traces` (dicts with a str "action") are never built as
// generic values: each is reduced, when its dict is filled, to the fields the replay reads (action code,
// addr, size, stream, time_us, device_free). The result is
//   - per device: the kept entries as columns (action code, addr, size, stream, time_us; an oom entry's
//     addr is its device_free, as trace.py's trace_from_snapshot reads it), the count of all its entries,
//     whether every kept entry carries the four numbers (columns_from_snapshot's lean path), the oom entries
//     whose addr and device_free differ (the lean path reads addr), and the rows that
//     trace.py::_rebuild_initial_segments needs (see reduce_scan);
//   - everything else (segments, allocator_settings, ...), with each device trace replaced by None,
//     written back as a small protocol-4 pickle of builtins only, which Python loads with the same
//     global-refusing Unpickler.
// A kept entry whose numbers are not all non-negative integers (or None / missing), or an entry that is not
// such a dict, makes the reader decline (Python's path then gives its own message or result).
//
// Interface: plain C functions for ctypes (no Python headers): sr_parse, sr_status, sr_message,
// sr_rest_size, sr_rest_copy, sr_devices, sr_device_info, sr_columns, sr_patches, sr_scan, sr_free.

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using i64 = int64_t;
using u8 = uint8_t;

enum Kind : u8 { K_NONE, K_BOOL, K_INT, K_BIGINT, K_FLOAT, K_STR, K_BYTES, K_LIST, K_DICT, K_TUPLE, K_ENTRY,
                 K_LOST = 254, K_EMPTY = 255 };

#pragma pack(push, 4)  // 12 bytes, not 16: the memo holds millions of them
struct Value {
    i64 v = 0;         // INT value; BOOL 0/1; STR/BYTES/BIGINT/FLOAT: offset in the data; containers: index
    uint32_t len : 24; // STR / BYTES / BIGINT: byte length (up to 16 MiB; longer: declined)
    uint32_t kind : 8;
    Value() : len(0), kind(K_EMPTY) {}
};
#pragma pack(pop)
static_assert(sizeof(Value) == 12, "Value is 12 bytes");

struct Cont {
    u8 kind = K_LIST;            // K_LIST, K_DICT, K_TUPLE
    u8 state = 0;       // emission: 0 not yet, 1 in progress, 2 done
    bool placeholder = false;  // a device trace read as columns: written back as None
    uint32_t refs = 0;  // times placed in a container
    uint32_t gets = 0;  // times fetched from the memo
    i64 memo_slot = -1;  // the memo slot holding it (-2: several)
    i64 memo_out = -1;
    std::vector<Value> items;  // dict: key, value, key, value, ...
};

// A trace entry, reduced. Field states: 0 missing, 1 None, 2 a non-negative int64, 3 anything else.
enum Field { F_ADDR, F_SIZE, F_STREAM, F_TIME, F_DEVFREE, N_FIELDS };
struct Entry {
    int8_t code;  // the kept action's code, -1: an action not kept (skipped)
    u8 state[N_FIELDS];
    i64 val[N_FIELDS];
};

enum Status { OK = 0, REFUSED = 1, DECLINED = 2 };

struct Device {
    i64 kind = -1;  // -1: written back as it was (None); else a placeholder
    i64 n_entries = 0;
    bool lean_ok = true;
    std::vector<uint32_t> rows;  // the kept entries (indices in Reader::entries), in order
    std::vector<i64> patches;  // (kept index, addr) pairs
    std::vector<u8> scan_act;
    std::vector<i64> scan_addr, scan_size, scan_stream;
};

struct Declined {};

struct Reader {
    const u8* d = nullptr;
    size_t n = 0, pos = 0;
    std::vector<std::string> kept_names;
    std::vector<int8_t> kept_codes;
    int alloc_code = -1, free_code = -1, oom_code = -1;
    int segment_codes[4] = {-1, -1, -1, -1};  // segment_alloc, segment_free, segment_map, segment_unmap

    std::vector<Value> stack;
    std::vector<size_t> marks;
    std::vector<Value> memo;
    std::vector<Cont> conts;
    std::vector<Entry> entries;

    int status = OK;
    std::string message;
    std::string rest;
    std::vector<Device> devices;

    // ------------------------------------------------------------------ reading the stream
    [[noreturn]] void decline(const char* why) {
        message = why;
        throw Declined();
    }
    [[noreturn]] void refuse(const std::string& why) {
        status = REFUSED;
        message = why;
        throw Declined();
    }
    // Framing (protocol 4+). Python's C unpickler reads a FRAME's bytes into its buffer and an opcode that
    // runs past the buffer's end is read afresh from the file, the buffer's rest skipped: reading linearly is
    // the same only when frames end between opcodes. So an opcode across a frame's end, a FRAME inside an
    // unfinished frame or a frame longer than the data makes the reader decline (Python then reads it).
    size_t frame_end = 0;  // end of the current frame; pos >= frame_end: none
    const u8* take(size_t k) {
        if (k > n - pos) decline("truncated");
        if (pos < frame_end && pos + k > frame_end) decline("an opcode across a frame's end");
        const u8* p = d + pos;
        pos += k;
        return p;
    }
    uint64_t le(size_t k) {
        const u8* p = take(k);
        uint64_t x = 0;
        for (size_t i = 0; i < k; ++i) x |= uint64_t(p[i]) << (8 * i);
        return x;
    }
    Value pop() {
        if (stack.empty() || (!marks.empty() && stack.size() <= marks.back())) decline("stack underflow");
        Value v = stack.back();
        stack.pop_back();
        return v;
    }
    size_t pop_mark() {
        if (marks.empty()) decline("no mark");
        size_t m = marks.back();
        marks.pop_back();
        return m;
    }
    Value& top() {
        if (stack.empty() || (!marks.empty() && stack.size() <= marks.back())) decline("stack underflow");
        return stack.back();
    }
    std::vector<i64> free_conts;  // containers no longer reachable (see recycle), reused
    Value new_cont(u8 kind) {
        Value v;
        v.kind = kind;
        if (!free_conts.empty()) {
            v.v = free_conts.back();
            free_conts.pop_back();
            Cont& c = conts[size_t(v.v)];
            c.kind = kind;
            c.state = 0;
            c.placeholder = false;
            c.refs = c.gets = 0;
            c.memo_slot = c.memo_out = -1;
            c.items.clear();
            return v;
        }
        Cont c;
        c.kind = kind;
        conts.push_back(std::move(c));
        v.v = i64(conts.size() - 1);
        return v;
    }
    // An empty container that only a compacted entry held (its "frames" list when no stack was recorded):
    // nothing reaches it but its memo slot, so its storage is reused and the slot marked: a later BINGET of
    // it gets a new empty container of the same kind (equal; what the entry held is not read).
    void recycle(const Value& x) {
        if (x.kind != K_LIST && x.kind != K_DICT) return;
        Cont& c = conts[size_t(x.v)];
        if (c.refs != 0 || c.gets != 0 || c.memo_slot == -2 || !c.items.empty()) return;
        if (c.memo_slot >= 0) {
            Value& m = memo[size_t(c.memo_slot)];
            if (m.kind != x.kind || m.v != x.v) return;
            m.kind = K_LOST;
            m.len = x.kind;
        }
        free_conts.push_back(x.v);
    }
    size_t memo_filled = 0;  // slots holding a value: MEMOIZE's index, as _pickle.c's memo_len
    void memo_put(uint64_t idx) {
        if (idx > memo.size() + (uint64_t(1) << 20)) decline("memo index far beyond the memo");
        if (idx == memo.size()) memo.push_back(Value());
        else if (memo.size() < idx) memo.resize(idx + 1);
        if (memo[idx].kind == K_EMPTY) ++memo_filled;
        memo[idx] = top();
        Value& v = memo[idx];
        if (v.kind == K_LIST || v.kind == K_DICT || v.kind == K_TUPLE) {
            Cont& c = conts[size_t(v.v)];
            c.memo_slot = c.memo_slot == -1 ? i64(idx) : -2;
        }
    }
    void memo_get(uint64_t idx) {
        if (idx >= memo.size() || memo[idx].kind == K_EMPTY) decline("memo value not found");
        if (memo[idx].kind == K_LOST) memo[idx] = new_cont(u8(memo[idx].len));  // an equal, empty one
        stack.push_back(memo[idx]);
        const Value& v = memo[idx];
        if (v.kind == K_LIST || v.kind == K_DICT || v.kind == K_TUPLE) conts[size_t(v.v)].gets++;
    }

    // Python decodes BINUNICODE as UTF-8 with "surrogatepass": the same bytes are accepted here.
    static bool valid_utf8(const u8* s, size_t len) {
        size_t i = 0;
        while (i < len) {
            u8 c = s[i];
            if (c < 0x80) { ++i; continue; }
            size_t need;
            u8 lo = 0x80, hi = 0xBF;
            if (c >= 0xC2 && c <= 0xDF) need = 1;
            else if (c == 0xE0) { need = 2; lo = 0xA0; }
            else if (c >= 0xE1 && c <= 0xEF) need = 2;
            else if (c == 0xF0) { need = 3; lo = 0x90; }
            else if (c >= 0xF1 && c <= 0xF3) need = 3;
            else if (c == 0xF4) { need = 3; hi = 0x8F; }
            else return false;
            if (i + need >= len) return false;
            if (s[i + 1] < lo || s[i + 1] > hi) return false;
            for (size_t k = 2; k <= need; ++k)
                if (s[i + k] < 0x80 || s[i + k] > 0xBF) return false;
            i += need + 1;
        }
        return true;
    }
    void push_str(size_t len, bool text) {
        if (len > n - pos) decline("truncated");
        if (pos < frame_end && pos + len > frame_end) decline("a string across a frame's end");
        if (len >= (size_t(1) << 24)) decline("a string of 16 MiB or more");
        Value v;
        v.kind = text ? K_STR : K_BYTES;
        v.len = uint32_t(len);
        v.v = i64(pos);
        if (text && !valid_utf8(d + pos, len)) decline("not UTF-8");
        pos += len;
        stack.push_back(v);
    }
    void push_long(size_t len) {
        const u8* p = take(len);
        Value v;
        if (len == 0) {
            v.kind = K_INT;
            v.v = 0;
        } else if (len <= 8) {
            uint64_t x = 0;
            for (size_t i = 0; i < len; ++i) x |= uint64_t(p[i]) << (8 * i);
            if (len < 8 && (p[len - 1] & 0x80)) x |= ~uint64_t(0) << (8 * len);  // sign-extend
            v.kind = K_INT;
            v.v = i64(x);
        } else {
            if (len >= (size_t(1) << 24)) decline("an integer of 16 MiB or more");
            v.kind = K_BIGINT;
            v.len = uint32_t(len);
            v.v = i64(p - d);
        }
        stack.push_back(v);
    }
    bool str_eq(const Value& v, const char* s, size_t len) const {
        return v.kind == K_STR && v.len == len && std::memcmp(d + v.v, s, len) == 0;
    }
    // Dict keys must be hashable in Python: lists and dicts (or tuples holding them) are not.
    bool hashable(const Value& v, int depth = 0) const {
        if (v.kind == K_LIST || v.kind == K_DICT || v.kind == K_ENTRY) return false;
        if (v.kind == K_TUPLE) {
            if (depth > 100) return false;
            for (const Value& x : conts[size_t(v.v)].items)
                if (!hashable(x, depth + 1)) return false;
        }
        return true;
    }

    // Which entry field a str key names (F_ADDR..F_DEVFREE, F_ACTION, or -1), and which kept action code a
    // str value is (-1: not kept). A string is its place in the data, and the keys and actions of the
    // entries are memoized strings fetched again and again: both answers are cached by that place.
    static constexpr int F_ACTION = N_FIELDS;
    struct Cached { i64 off = -1; int answer = 0; };
    Cached field_cache[64], action_cache[64];
    int field_of(const Value& k) {
        Cached& c = field_cache[size_t(k.v) & 63];
        if (c.off == k.v) return c.answer;
        static const char* names[N_FIELDS + 1] = {"addr", "size", "stream", "time_us", "device_free", "action"};
        static const size_t lens[N_FIELDS + 1] = {4, 4, 6, 7, 11, 6};
        int answer = -1;
        for (int f = 0; f <= N_FIELDS; ++f)
            if (str_eq(k, names[f], lens[f])) { answer = f; break; }
        c.off = k.v;
        c.answer = answer;
        return answer;
    }
    int action_code(const Value& a) {
        Cached& c = action_cache[size_t(a.v) & 63];
        if (c.off == a.v) return c.answer;
        int answer = -1;
        for (size_t k = 0; k < kept_names.size(); ++k)
            if (str_eq(a, kept_names[k].data(), kept_names[k].size())) { answer = kept_codes[k]; break; }
        c.off = a.v;
        c.answer = answer;
        return answer;
    }

    // The dict being filled becomes an Entry when it is a fresh dict with str keys and a str "action".
    bool try_entry(Value& target, const Value* kv, size_t count) {
        int fields[64];
        if (count > 128) return false;
        int action = -1;
        for (size_t i = 0; i < count; i += 2) {
            if (kv[i].kind != K_STR) return false;
            int f = field_of(kv[i]);
            fields[i / 2] = f;
            if (f == F_ACTION) action = int(i);
        }
        if (action < 0 || kv[action + 1].kind != K_STR) return false;
        Entry e;
        e.code = int8_t(action_code(kv[action + 1]));
        for (int f = 0; f < N_FIELDS; ++f) { e.state[f] = 0; e.val[f] = 0; }
        for (size_t i = 0; i < count; i += 2) {
            int f = fields[i / 2];
            if (f < 0 || f == F_ACTION) continue;
            const Value& x = kv[i + 1];
            if (x.kind == K_NONE) { e.state[f] = 1; e.val[f] = 0; }
            else if (x.kind == K_INT && x.v >= 0) { e.state[f] = 2; e.val[f] = x.v; }
            else { e.state[f] = 3; e.val[f] = 0; }
        }
        entries.push_back(e);
        target.kind = K_ENTRY;
        target.v = i64(entries.size() - 1);
        return true;
    }

    void setitems(size_t from) {
        size_t count = stack.size() - from;
        if (count % 2) decline("odd setitems");
        if (from == 0) decline("stack underflow");
        Value& target = stack[from - 1];
        if (target.kind == K_ENTRY) decline("entry dict filled twice");
        if (target.kind != K_DICT) decline("setitems on a non-dict");
        for (size_t i = from; i < stack.size(); i += 2)
            if (!hashable(stack[i])) decline("unhashable key");
        Cont& c = conts[size_t(target.v)];
        if (c.items.empty() && count > 0 && c.refs == 0 && c.gets == 0 && c.memo_slot != -2) {
            // a fresh dict that nothing else holds yet (but the memo slot it was put in, as pickle does
            // before filling it): a trace entry?
            i64 slot = c.memo_slot, idx = target.v;
            if (try_entry(target, stack.data() + from, count)) {
                if (slot >= 0 && memo[size_t(slot)].kind == K_DICT && memo[size_t(slot)].v == idx)
                    memo[size_t(slot)] = target;
                for (size_t i = from + 1; i < stack.size(); i += 2) recycle(stack[i]);
                free_conts.push_back(idx);  // the dict's own slot: it is the Entry now
                stack.resize(from);
                return;
            }
        }
        for (size_t i = from; i < stack.size(); ++i) {
            Value& x = stack[i];
            if (x.kind == K_LIST || x.kind == K_DICT || x.kind == K_TUPLE) conts[size_t(x.v)].refs++;
            c.items.push_back(x);
        }
        stack.resize(from);
    }
    void appends(size_t from) {
        if (from == 0) decline("stack underflow");
        Value& target = stack[from - 1];
        if (target.kind != K_LIST) decline("append to a non-list");
        Cont& c = conts[size_t(target.v)];
        for (size_t i = from; i < stack.size(); ++i) {
            Value& x = stack[i];
            if (x.kind == K_LIST || x.kind == K_DICT || x.kind == K_TUPLE) conts[size_t(x.v)].refs++;
            c.items.push_back(x);
        }
        stack.resize(from);
    }
    void make_tuple(size_t from) {
        Value t = new_cont(K_TUPLE);
        Cont& c = conts[size_t(t.v)];
        for (size_t i = from; i < stack.size(); ++i) {
            Value& x = stack[i];
            if (x.kind == K_LIST || x.kind == K_DICT || x.kind == K_TUPLE) conts[size_t(x.v)].refs++;
            c.items.push_back(x);
        }
        stack.resize(from);
        stack.push_back(t);
    }
    std::string line() {
        size_t start = pos;
        while (pos < n && d[pos] != '\n') ++pos;
        if (pos >= n) decline("truncated");
        if (start < frame_end && pos >= frame_end) decline("a line across a frame's end");
        std::string s(reinterpret_cast<const char*>(d + start), pos - start);
        ++pos;
        return s;
    }

    Value parse() {
        // generous reservations: address space only, the pages untouched cost nothing (a trace entry takes
        // at least 16 bytes of pickle and two memo slots)
        memo.reserve(n / 4 + 1024);
        entries.reserve(n / 16 + 1024);
        stack.reserve(1024);
        for (;;) {
            u8 op = *take(1);
            switch (op) {
            case 0x80: {  // PROTO
                u8 proto = *take(1);
                if (proto < 2 || proto > 5) decline("protocol");
                break;
            }
            case 0x95: {  // FRAME
                uint64_t len = le(8);
                if (pos < frame_end) decline("a frame inside a frame");
                if (len > n - pos) decline("truncated frame");
                frame_end = pos + size_t(len);
                break;
            }
            case '.':  // STOP
                return pop();
            case '}': stack.push_back(new_cont(K_DICT)); break;
            case ']': stack.push_back(new_cont(K_LIST)); break;
            case ')': make_tuple(stack.size()); break;
            case '(': marks.push_back(stack.size()); break;
            case 'a': {  // APPEND
                Value v = pop();
                stack.push_back(v);
                appends(stack.size() - 1);
                break;
            }
            case 'e': appends(pop_mark()); break;
            case 's': {  // SETITEM
                Value v = pop();
                Value k = pop();
                stack.push_back(k);
                stack.push_back(v);
                setitems(stack.size() - 2);
                break;
            }
            case 'u': setitems(pop_mark()); break;
            case 't': make_tuple(pop_mark()); break;
            case 0x85: case 0x86: case 0x87: {  // TUPLE1-3
                size_t k = size_t(op - 0x84);
                if (stack.size() < k || (!marks.empty() && stack.size() - k < marks.back())) decline("underflow");
                make_tuple(stack.size() - k);
                break;
            }
            case 'X': push_str(size_t(le(4)), true); break;
            case 0x8c: push_str(size_t(le(1)), true); break;
            case 0x8d: push_str(size_t(le(8)), true); break;
            case 'C': push_str(size_t(le(1)), false); break;
            case 'B': push_str(size_t(le(4)), false); break;
            case 0x8e: push_str(size_t(le(8)), false); break;
            case 'J': {
                Value v;
                v.kind = K_INT;
                v.v = int32_t(uint32_t(le(4)));
                stack.push_back(v);
                break;
            }
            case 'K': { Value v; v.kind = K_INT; v.v = i64(le(1)); stack.push_back(v); break; }
            case 'M': { Value v; v.kind = K_INT; v.v = i64(le(2)); stack.push_back(v); break; }
            case 0x8a: push_long(size_t(le(1))); break;
            case 0x8b: {
                uint64_t len = le(4);
                if (len & 0x80000000ull) decline("negative LONG4 size");
                push_long(size_t(len));
                break;
            }
            case 'G': { Value v; v.kind = K_FLOAT; v.v = i64(pos); take(8); stack.push_back(v); break; }
            case 'N': { Value v; v.kind = K_NONE; stack.push_back(v); break; }
            case 0x88: { Value v; v.kind = K_BOOL; v.v = 1; stack.push_back(v); break; }
            case 0x89: { Value v; v.kind = K_BOOL; v.v = 0; stack.push_back(v); break; }
            case 'q': memo_put(le(1)); break;
            case 'r': memo_put(le(4)); break;
            case 0x94: memo_put(memo_filled); break;
            case 'h': memo_get(le(1)); break;
            case 'j': memo_get(le(4)); break;
            // -------- refused: these name or call objects
            case 'c': case 'i': {  // GLOBAL, INST: "module\nname\n", looked up before anything else (INST:
                                   // after finding its MARK)
                if (op == 'i' && marks.empty()) decline("INST without a MARK");
                std::string module = line();
                std::string name = line();
                if (!valid_utf8(reinterpret_cast<const u8*>(module.data()), module.size()) ||
                    !valid_utf8(reinterpret_cast<const u8*>(name.data()), name.size()))
                    decline("a global's name is not UTF-8");
                refuse("names the global " + module + "." + name);
            }
            case 0x93: {  // STACK_GLOBAL
                Value name = pop();
                Value module = pop();
                if (name.kind != K_STR || module.kind != K_STR) decline("STACK_GLOBAL requires str");
                refuse("names the global " + std::string(reinterpret_cast<const char*>(d + module.v), module.len)
                       + "." + std::string(reinterpret_cast<const char*>(d + name.v), name.len));
            }
            case 'R': refuse("uses the opcode REDUCE (a call)");
            case 'b': refuse("uses the opcode BUILD (sets an object's state)");
            case 'o': refuse("uses the opcode OBJ (builds an object)");
            case 0x81: refuse("uses the opcode NEWOBJ (builds an object)");
            case 0x92: refuse("uses the opcode NEWOBJ_EX (builds an object)");
            case 'P': case 'Q': refuse("uses a persistent id (PERSID / BINPERSID)");
            case 0x82: case 0x83: case 0x84: refuse("uses an extension code (EXT1 / EXT2 / EXT4)");
            default:
                decline("an opcode memory snapshots do not use");
            }
        }
    }

    // ------------------------------------------------------------------ the device traces
    void extract(const Value& top) {
        if (top.kind != K_DICT) return;
        const Cont& c = conts[size_t(top.v)];
        const Value* dt = nullptr;
        for (size_t i = 0; i < c.items.size(); i += 2)
            if (str_eq(c.items[i], "device_traces", 13)) dt = &c.items[i + 1];
        if (dt == nullptr || dt->kind != K_LIST) return;
        Cont& traces = conts[size_t(dt->v)];
        if (traces.refs != 1) decline("device_traces shared");
        for (const Value& t : traces.items) {
            Device dev;
            if (t.kind == K_LIST) {
                Cont& tc = conts[size_t(t.v)];
                if (tc.refs != 1) decline("a device trace shared");
                for (const Value& e : tc.items)
                    if (e.kind != K_ENTRY) decline("a trace entry that is not a dict with a str action");
                dev.kind = 0;
                tc.placeholder = true;
                read_device(tc, dev);
            } else if (t.kind == K_DICT || t.kind == K_TUPLE || t.kind == K_ENTRY) {
                decline("a device trace that is not a list");
            }
            devices.push_back(std::move(dev));
        }
    }

    // A kept row's address: an oom entry's device_free when it has one (trace_from_snapshot's reading).
    i64 row_addr(const Entry& e) const {
        return (e.code == oom_code && e.state[F_DEVFREE] != 0) ? e.val[F_DEVFREE] : e.val[F_ADDR];
    }

    void read_device(const Cont& tc, Device& dev) {
        dev.n_entries = i64(tc.items.size());
        dev.rows.reserve(tc.items.size());
        for (const Value& ev : tc.items) {
            const Entry& e = entries[size_t(ev.v)];
            if (e.code < 0) continue;
            for (int f = 0; f < F_DEVFREE; ++f) {
                if (e.state[f] == 3) decline("a kept entry's number is not a non-negative integer");
                if (e.state[f] != 2) dev.lean_ok = false;
            }
            if (e.code == oom_code && e.state[F_DEVFREE] != 0) {  // PyTorch's layout: device_free, no addr
                if (e.state[F_DEVFREE] == 3) decline("an oom entry's device_free is not a non-negative integer");
                i64 addr = e.val[F_DEVFREE];
                if (e.state[F_ADDR] == 2 && e.val[F_ADDR] != addr) {  // the lean path reads addr
                    dev.patches.push_back(i64(dev.rows.size()));
                    dev.patches.push_back(e.val[F_ADDR]);
                }
            }
            dev.rows.push_back(uint32_t(ev.v));
        }
        if (!dev.lean_ok) dev.patches.clear();
        reduce_scan(dev);
    }

    // An open-addressing set of addresses (linear probing, tombstones; doubles at half full).
    struct AddrSet {
        std::vector<uint64_t> slots;
        std::vector<u8> used;  // 0 empty, 1 full, 2 tombstone
        size_t count = 0, tombs = 0, mask = 0;
        AddrSet() { rehash(64); }
        void rehash(size_t cap) {
            std::vector<uint64_t> old_slots;
            std::vector<u8> old_used;
            old_slots.swap(slots);
            old_used.swap(used);
            slots.assign(cap, 0);
            used.assign(cap, 0);
            mask = cap - 1;
            count = tombs = 0;
            for (size_t i = 0; i < old_used.size(); ++i)
                if (old_used[i] == 1) add(old_slots[i]);
        }
        static size_t h(uint64_t x) { x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; return size_t(x); }
        size_t find(uint64_t x) const {
            size_t i = h(x) & mask;
            while (used[i] != 0 && !(used[i] == 1 && slots[i] == x)) i = (i + 1) & mask;
            return i;
        }
        bool contains(uint64_t x) const { return used[find(x)] == 1; }
        void add(uint64_t x) {
            if (2 * (count + tombs + 1) > slots.size()) rehash(count * 4 > slots.size() ? slots.size() * 2 : slots.size());
            size_t i = h(x) & mask, tomb = SIZE_MAX;
            while (used[i] != 0) {
                if (used[i] == 1 && slots[i] == x) return;
                if (used[i] == 2 && tomb == SIZE_MAX) tomb = i;
                i = (i + 1) & mask;
            }
            if (tomb != SIZE_MAX) { i = tomb; --tombs; }
            slots[i] = x;
            used[i] = 1;
            ++count;
        }
        void discard(uint64_t x) {
            size_t i = find(x);
            if (used[i] == 1) { used[i] = 2; --count; ++tombs; }
        }
    };

    // _rebuild_initial_segments's rows, fewer. It reads every row in order; what it keeps is: the live set
    // (alloc adds, free_completed removes), the frees of blocks not live (pre-trace blocks) with their
    // index, every allocation's (address, index) for proven_end (compared only with those frees' indices),
    // the segment rows, and the row count. With K the index of the last pre-trace free, every row up to K is
    // kept as it is; after K: the segment rows, and for each address allocated or freed after K one
    // synthetic row taking it from its state at K to its state at the end (an allocation after K cannot
    // prove a block start: proven_end counts only those before the block's free, all <= K). One trailing
    // oom row (no effect but the count) stands for the rows left out, so an empty result means an empty trace.
    void reduce_scan(Device& dev) {
        size_t m = dev.rows.size();
        auto act_of = [&](size_t i) { return int(entries[dev.rows[i]].code); };
        auto addr_of = [&](size_t i) { return row_addr(entries[dev.rows[i]]); };
        AddrSet live, segments;
        i64 K = -1;
        // A live address allocated again (an alloc with no free_completed since the last alloc there, a
        // segment_alloc with no segment_free since): the caching allocator never does it, and the replay would
        // count the block or segment twice. Declined: Python's path (trace.py _refuse_duplicate_live) names
        // the file and the entry in one line.
        for (size_t i = 0; i < m; ++i) {
            int a = act_of(i);
            if (a == alloc_code) {
                if (live.contains(uint64_t(addr_of(i)))) decline("a live block's address allocated again");
                live.add(uint64_t(addr_of(i)));
            } else if (a == free_code) {
                if (live.contains(uint64_t(addr_of(i)))) live.discard(uint64_t(addr_of(i)));
                else K = i64(i);
            } else if (a == segment_codes[0]) {
                if (segments.contains(uint64_t(addr_of(i)))) decline("a live segment's address allocated again");
                segments.add(uint64_t(addr_of(i)));
            } else if (a == segment_codes[1]) {
                segments.discard(uint64_t(addr_of(i)));
            }
        }
        auto keep = [&](size_t i) {
            const Entry& e = entries[dev.rows[i]];
            dev.scan_act.push_back(u8(e.code));
            dev.scan_addr.push_back(row_addr(e));
            dev.scan_size.push_back(e.val[F_SIZE]);
            dev.scan_stream.push_back(e.val[F_STREAM]);
        };
        AddrSet at_k;
        size_t i = 0;
        for (; i < m && i64(i) <= K; ++i) {
            keep(i);
            int a = act_of(i);
            if (a == alloc_code) at_k.add(uint64_t(addr_of(i)));
            else if (a == free_code) at_k.discard(uint64_t(addr_of(i)));
        }
        if (i == m) return;
        // live is the state at the end; at_k the state at K
        std::vector<i64> touched;
        AddrSet seen;
        for (; i < m; ++i) {
            int a = act_of(i);
            if (a == alloc_code || a == free_code) {
                uint64_t x = uint64_t(addr_of(i));
                if (!seen.contains(x)) { seen.add(x); touched.push_back(i64(x)); }
            } else if (a == segment_codes[0] || a == segment_codes[1] || a == segment_codes[2] ||
                       a == segment_codes[3]) {
                keep(i);
            }
        }
        for (i64 x : touched) {
            bool before = at_k.contains(uint64_t(x)), after = live.contains(uint64_t(x));
            if (before == after) continue;
            dev.scan_act.push_back(u8(after ? alloc_code : free_code));
            dev.scan_addr.push_back(x);
            dev.scan_size.push_back(0);
            dev.scan_stream.push_back(0);
        }
        dev.scan_act.push_back(u8(oom_code));
        dev.scan_addr.push_back(0);
        dev.scan_size.push_back(0);
        dev.scan_stream.push_back(0);
    }

    // ------------------------------------------------------------------ the rest, as a pickle
    std::unordered_map<i64, i64> str_memo;
    i64 memo_count = 0;
    int depth = 0;

    void w(u8 b) { rest.push_back(char(b)); }
    void w4(uint64_t x) { for (int i = 0; i < 4; ++i) rest.push_back(char((x >> (8 * i)) & 0xFF)); }
    void memoize() { w(0x94); ++memo_count; }
    void get(i64 id) { w('j'); w4(uint64_t(id)); }

    void emit(const Value& v) {
        switch (v.kind) {
        case K_NONE: w('N'); return;
        case K_BOOL: w(v.v ? 0x88 : 0x89); return;
        case K_INT:
            if (v.v >= 0 && v.v < 256) { w('K'); w(u8(v.v)); }
            else if (v.v >= INT32_MIN && v.v <= INT32_MAX) { w('J'); w4(uint64_t(uint32_t(int32_t(v.v)))); }
            else { w(0x8a); w(8); for (int i = 0; i < 8; ++i) w(u8((uint64_t(v.v) >> (8 * i)) & 0xFF)); }
            return;
        case K_BIGINT:
            w(0x8b); w4(v.len); rest.append(reinterpret_cast<const char*>(d + v.v), v.len);
            return;
        case K_FLOAT: w('G'); rest.append(reinterpret_cast<const char*>(d + v.v), 8); return;
        case K_STR: case K_BYTES: {
            auto it = str_memo.find(v.kind == K_STR ? v.v : -1 - v.v);
            if (it != str_memo.end()) { get(it->second); return; }
            w(v.kind == K_STR ? 'X' : 'B');
            w4(v.len);
            rest.append(reinterpret_cast<const char*>(d + v.v), v.len);
            str_memo[v.kind == K_STR ? v.v : -1 - v.v] = memo_count;
            memoize();
            return;
        }
        case K_ENTRY: decline("a trace entry outside device_traces");
        default: break;
        }
        Cont& c = conts[size_t(v.v)];
        if (c.placeholder) { w('N'); return; }
        if (c.memo_out >= 0) { get(c.memo_out); return; }
        if (c.state == 1) decline("a tuple that holds itself");
        if (++depth > 10000) decline("nested too deep");
        if (c.kind == K_TUPLE) {
            c.state = 1;
            w('(');
            for (size_t i = 0; i < c.items.size(); ++i) emit(conts[size_t(v.v)].items[i]);
            Cont& cc = conts[size_t(v.v)];
            if (cc.memo_out >= 0) decline("a tuple that holds itself");
            w('t');
            cc.memo_out = memo_count;
            memoize();
            cc.state = 2;
        } else {
            w(c.kind == K_LIST ? ']' : '}');
            c.memo_out = memo_count;
            memoize();
            c.state = 1;
            size_t k = c.items.size();
            if (k) {
                w('(');
                for (size_t i = 0; i < k; ++i) emit(conts[size_t(v.v)].items[i]);
                w(c.kind == K_LIST ? 'e' : 'u');
            }
            conts[size_t(v.v)].state = 2;
        }
        --depth;
    }

    void run() {
        try {
            Value top = parse();
            extract(top);
            rest.reserve(1 << 16);
            w(0x80); w(4);
            emit(top);
            w('.');
        } catch (const Declined&) {
            if (status == OK) status = DECLINED;
            rest.clear();
            devices.clear();
        } catch (const std::exception& exc) {  // bad_alloc: Python's reader then tries
            status = DECLINED;
            message = std::string("out of memory (") + exc.what() + ")";
            rest.clear();
            devices.clear();
        }
        std::vector<Value>().swap(stack);
        std::vector<Value>().swap(memo);
        std::vector<Cont>().swap(conts);
        if (status != OK) std::vector<Entry>().swap(entries);  // else the columns are read from them
    }
};

}  // namespace

extern "C" {

// kept: n_kept NUL-terminated action names back to back, codes: their action codes; special: the codes of
// alloc, free_completed, oom, segment_alloc, segment_free, segment_map, segment_unmap.
void* sr_parse(const char* data, i64 n, i64 n_kept, const char* kept, const int8_t* codes, const int8_t* special) {
    Reader* r = new Reader();
    r->d = reinterpret_cast<const u8*>(data);
    r->n = size_t(n);
    for (i64 k = 0; k < n_kept; ++k) {
        r->kept_names.emplace_back(kept);
        kept += r->kept_names.back().size() + 1;
        r->kept_codes.push_back(codes[k]);
    }
    r->alloc_code = special[0];
    r->free_code = special[1];
    r->oom_code = special[2];
    for (int k = 0; k < 4; ++k) r->segment_codes[k] = special[3 + k];
    r->run();
    return r;
}

i64 sr_status(void* h) { return static_cast<Reader*>(h)->status; }
const char* sr_message(void* h) { return static_cast<Reader*>(h)->message.c_str(); }
i64 sr_rest_size(void* h) { return i64(static_cast<Reader*>(h)->rest.size()); }
void sr_rest_copy(void* h, char* out) {
    const std::string& s = static_cast<Reader*>(h)->rest;
    std::memcpy(out, s.data(), s.size());
}
i64 sr_devices(void* h) { return i64(static_cast<Reader*>(h)->devices.size()); }

// per device: kind (-1: as written back, 0: columns), entries, kept rows, lean_ok, patches, scan rows
void sr_device_info(void* h, i64* out) {
    for (const Device& dev : static_cast<Reader*>(h)->devices) {
        *out++ = dev.kind;
        *out++ = dev.n_entries;
        *out++ = i64(dev.rows.size());
        *out++ = dev.lean_ok;
        *out++ = i64(dev.patches.size() / 2);
        *out++ = i64(dev.scan_act.size());
    }
}

void sr_columns(void* h, i64 k, uint8_t* act, i64* addr, i64* size, i64* stream, i64* time) {
    const Device& dev = static_cast<Reader*>(h)->devices[size_t(k)];
    const Reader* r = static_cast<Reader*>(h);
    size_t m = dev.rows.size();
    for (size_t i = 0; i < m; ++i) {
        const Entry& e = r->entries[dev.rows[i]];
        act[i] = uint8_t(e.code);
        addr[i] = r->row_addr(e);
        size[i] = e.val[F_SIZE];
        stream[i] = e.val[F_STREAM];
        time[i] = e.val[F_TIME];
    }
}

void sr_patches(void* h, i64 k, i64* out) {
    const Device& dev = static_cast<Reader*>(h)->devices[size_t(k)];
    if (!dev.patches.empty()) std::memcpy(out, dev.patches.data(), 8 * dev.patches.size());
}

void sr_scan(void* h, i64 k, uint8_t* act, i64* addr, i64* size, i64* stream) {
    const Device& dev = static_cast<Reader*>(h)->devices[size_t(k)];
    size_t m = dev.scan_act.size();
    if (!m) return;
    std::memcpy(act, dev.scan_act.data(), m);
    std::memcpy(addr, dev.scan_addr.data(), 8 * m);
    std::memcpy(size, dev.scan_size.data(), 8 * m);
    std::memcpy(stream, dev.scan_stream.data(), 8 * m);
}

void sr_free(void* h) { delete static_cast<Reader*>(h); }

}  // extern "C"
