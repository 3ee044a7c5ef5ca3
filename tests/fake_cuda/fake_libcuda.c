// A logging stand-in for libcuda; tests/fake_cuda/__init__.py says how the tests load and read it.
// - Per "physical" GPU a UUID and a PCI bus id; STUB_VISIBLE=1,0 renumbers them as CUDA_VISIBLE_DEVICES does.
// - Primary contexts are reference-counted; the log says CREATED / DESTROYED, and whether a destroyed one
//   was left current.
// - Each VMM call logs the context current on the calling thread.
// - Injected failures: STUB_{CREATE,EXPORT,IMPORT}_FAIL_TYPE=1|8 (POSIX FD | FABRIC), STUB_EXPORT_FAIL_NTH=n,
//   STUB_SETACCESS_FAIL_DEV=d, STUB_HOSTREGISTER_FAIL=1; STUB_NO_RDMA_DEV=d: device d reports no GPUDirect RDMA
//   with VMM. STUB_UNMAP_SLEEP_MS=n: cuMemUnmap takes n ms (after logging), as a driver waiting for the GPU would.
// - STUB_LOG=FILE: where the log goes (stderr otherwise).
// - Streams, events and their order (see the section below): work queued on a stream completes in order,
//   a "kernel" only once the test releases it (fake_launch / fake_release, through ctypes); events,
//   stream waits, stream memory operations and stream capture follow the driver's documented rules, and
//   each completion is logged, so a test can read whether a wait came before the work it had to follow.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <time.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long u64;

#define ATTR_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED 110
#define ATTR_GPU_DIRECT_RDMA_WRITES_ORDERING 118
#define ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS 122
#define CTX(dev) ((void*)(uintptr_t)(0x1000 + (dev)))

static __thread void* cur = 0;
static int refs[8];
static int nvis = -1, phys[8];
static int ncreate = 0, nexport = 0;

static FILE* L(void) {
    static FILE* f;
    if (!f) {
        const char* p = getenv("STUB_LOG");
        f = p ? fopen(p, "a") : stderr;
        setvbuf(f, NULL, _IONBF, 0);
    }
    return f;
}

static int envi(const char* n) {
    const char* v = getenv(n);
    return v ? atoi(v) : -1;
}

static void vis(void) {
    if (nvis >= 0) return;
    nvis = 0;
    const char* v = getenv("STUB_VISIBLE");
    if (!v) v = "0,1";
    char buf[64];
    snprintf(buf, 64, "%s", v);
    for (char* t = strtok(buf, ","); t && nvis < 8; t = strtok(NULL, ",")) phys[nvis++] = atoi(t);
}

#define CUR() fprintf(L(), "    [current ctx %p]\n", cur)

CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
CUresult cuInit(unsigned f) { fprintf(L(), "cuInit(%u)\n", f); return 0; }

CUresult cuGetErrorName(int e, const char** s) {
    static char buf[64];
    snprintf(buf, 64, "CUDA_ERROR_STUB_%d", e);
    *s = buf;
    return 0;
}
CUresult cuGetErrorString(int e, const char** s) { return cuGetErrorName(e, s); }

CUresult cuDeviceGetCount(int* c) { vis(); *c = nvis; return 0; }
CUresult cuDeviceGet(int* d, int o) {
    vis();
    if (o < 0 || o >= nvis) return 101;
    *d = o;
    return 0;
}

CUresult cuDeviceGetAttribute(int* pi, int attr, int dev) {
    *pi = (attr == ATTR_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED && envi("STUB_NO_RDMA_DEV") == dev) ? 0 : 1;
    // GPU_DIRECT_RDMA_WRITES_ORDERING: NONE (0) unless STUB_RDMA_ORDERING says OWNER (100) or ALL_DEVICES (200)
    if (attr == ATTR_GPU_DIRECT_RDMA_WRITES_ORDERING) *pi = envi("STUB_RDMA_ORDERING") > 0 ? envi("STUB_RDMA_ORDERING") : 0;
    // STUB_NO_STREAM_MEM_OPS=1: a device whose streams cannot write or wait on 64-bit words
    if (attr == ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS && envi("STUB_NO_STREAM_MEM_OPS") > 0) *pi = 0;
    fprintf(L(), "cuDeviceGetAttribute(attr=%d, dev=%d)\n", attr, dev);
    return 0;
}

CUresult cuFlushGPUDirectRDMAWrites(int target, int scope) {
    fprintf(L(), "cuFlushGPUDirectRDMAWrites(target=%d, scope=%d)\n", target, scope);
    CUR();
    return 0;
}

CUresult cuDeviceGetUuid_v2(unsigned char* u, int dev) {
    vis();
    memset(u, 0, 16);
    u[0] = 0xAA;
    u[15] = (unsigned char)phys[dev];
    fprintf(L(), "cuDeviceGetUuid(dev=%d -> phys %d)\n", dev, phys[dev]);
    return 0;
}
CUresult cuDeviceGetUuid(unsigned char* u, int dev) { return cuDeviceGetUuid_v2(u, dev); }

CUresult cuDeviceGetPCIBusId(char* buf, int len, int dev) {
    vis();
    snprintf(buf, len, "0000:%02X:00.0", 0x18 + phys[dev]);
    fprintf(L(), "cuDeviceGetPCIBusId(dev=%d) -> %s\n", dev, buf);
    return 0;
}

CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) {
    *ctx = CTX(dev);
    if (refs[dev]++ == 0) fprintf(L(), "  ** primary ctx dev %d CREATED\n", dev);
    fprintf(L(), "cuDevicePrimaryCtxRetain(dev=%d) refs=%d\n", dev, refs[dev]);
    return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
    refs[dev]--;
    const char* gone = refs[dev] == 0 ? "  ** DESTROYED" : "";
    fprintf(L(), "cuDevicePrimaryCtxRelease(dev=%d) refs=%d%s\n", dev, refs[dev], gone);
    if (refs[dev] == 0 && cur == CTX(dev)) fprintf(L(), "  !! destroyed ctx still current\n");
    return 0;
}
CUresult cuDevicePrimaryCtxRelease(int dev) { return cuDevicePrimaryCtxRelease_v2(dev); }
CUresult cuDevicePrimaryCtxGetState(int dev, unsigned* flags, int* active) {
    *flags = 0;
    *active = refs[dev] > 0;
    fprintf(L(), "cuDevicePrimaryCtxGetState(dev=%d) active=%d\n", dev, *active);
    return 0;
}

CUresult cuCtxSetCurrent(void* ctx) { fprintf(L(), "cuCtxSetCurrent(%p)\n", ctx); cur = ctx; return 0; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = cur; return 0; }
CUresult cuCtxGetDevice(int* dev) { if (!cur) return 201; *dev = (int)((uintptr_t)cur - 0x1000); return 0; }

// CUmemAllocationProp: type@0, requestedHandleTypes@4, location.type@8, location.id@12,
// win32HandleMetaData@16, allocFlags.compressionType@24, allocFlags.gpuDirectRDMACapable@25.
CUresult cuMemGetAllocationGranularity(size_t* g, const int* prop, int opt) {
    fprintf(L(), "cuMemGetAllocationGranularity(opt=%d, handleTypes=%d, dev=%d)\n", opt, prop[1], prop[3]);
    CUR();
    *g = 2u << 20;
    return 0;
}
CUresult cuMemCreate(u64* h, size_t size, const int* prop, u64 flags) {
    fprintf(L(), "cuMemCreate(size=%zu, handleTypes=%d, dev=%d, gpuDirectRDMACapable=%d)\n", size, prop[1], prop[3],
            ((const unsigned char*)prop)[25]);
    CUR();
    if (envi("STUB_CREATE_FAIL_TYPE") == prop[1]) return 801;
    *h = 0xABC0 + (ncreate++);
    return 0;
}
CUresult cuMemExportToShareableHandle(void* out, u64 h, int type, u64 flags) {
    nexport++;
    fprintf(L(), "cuMemExportToShareableHandle(h=%#llx, type=%d) #%d\n", h, type, nexport);
    CUR();
    int nth = envi("STUB_EXPORT_FAIL_NTH");
    if (envi("STUB_EXPORT_FAIL_TYPE") == type && (nth < 0 || nth == nexport)) {
        fprintf(L(), "  -> FAIL\n");
        return 801;
    }
    if (type == 1) {
        int fd = memfd_create("stubvmm", 0);
        *(int*)out = fd;
        fprintf(L(), "  -> fd %d\n", fd);
    } else if (type == 8) {
        unsigned char* p = out;
        for (int i = 0; i < 64; i++) p[i] = (unsigned char)(0xA0 + i);
    }
    return 0;
}
CUresult cuMemImportFromShareableHandle(u64* h, void* os, int type) {
    fprintf(L(), "cuMemImportFromShareableHandle(type=%d)\n", type);
    CUR();
    if (type == 1) {
        int fd = (int)(intptr_t)os;
        fprintf(L(), "  fd %d valid=%d\n", fd, fcntl(fd, F_GETFD) != -1);
    } else if (type == 8) {
        fprintf(L(), "  fabric[0]=%02x [63]=%02x\n", ((unsigned char*)os)[0], ((unsigned char*)os)[63]);
    }
    if (envi("STUB_IMPORT_FAIL_TYPE") == type) return 801;
    *h = 0xDEF0;
    return 0;
}
CUresult cuMemRelease(u64 h) { fprintf(L(), "cuMemRelease(%#llx)\n", h); CUR(); return 0; }
CUresult cuMemAddressReserve(u64* ptr, size_t size, size_t align, u64 addr, u64 flags) {
    fprintf(L(), "cuMemAddressReserve(size=%zu, align=%zu)\n", size, align);
    CUR();
    *ptr = 0x7f0000000000ULL;
    return 0;
}
CUresult cuMemMap(u64 ptr, size_t size, size_t off, u64 h, u64 flags) {
    fprintf(L(), "cuMemMap(ptr=%#llx, size=%zu, off=%zu, h=%#llx)\n", ptr, size, off, h);
    CUR();
    return 0;
}
CUresult cuMemSetAccess(u64 ptr, size_t size, const int* desc, size_t count) {
    fprintf(L(), "cuMemSetAccess(ptr=%#llx, size=%zu, dev=%d, flags=%d)\n", ptr, size, desc[1], desc[2]);
    CUR();
    return envi("STUB_SETACCESS_FAIL_DEV") == desc[1] ? 217 : 0;
}
CUresult cuMemUnmap(u64 ptr, size_t size) {
    fprintf(L(), "cuMemUnmap(%#llx, %zu)\n", ptr, size);
    CUR();
    if (envi("STUB_UNMAP_SLEEP_MS") > 0) usleep(1000 * envi("STUB_UNMAP_SLEEP_MS"));
    return 0;
}
CUresult cuMemAddressFree(u64 ptr, size_t size) { fprintf(L(), "cuMemAddressFree(%#llx, %zu)\n", ptr, size); return 0; }

CUresult cuMemHostRegister_v2(void* p, size_t size, unsigned flags) {
    fprintf(L(), "cuMemHostRegister(%p, size=%zu, flags=%u)\n", p, size, flags);
    CUR();
    return envi("STUB_HOSTREGISTER_FAIL") == 1 ? 712 : 0;  // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
}
CUresult cuMemHostRegister(void* p, size_t size, unsigned flags) { return cuMemHostRegister_v2(p, size, flags); }
CUresult cuMemHostUnregister(void* p) { fprintf(L(), "cuMemHostUnregister(%p)\n", p); CUR(); return 0; }


// ---- Streams, events, their order ---------------------------------------------------------------
// A stream is a FIFO of operations; the head completes when its condition holds: a kernel once released
// (fake_release), a wait on an event once the work that event captured is done, a wait on a 64-bit word
// once the word satisfies it; a write of a word completes at once and stores it. Stream 0 (the NULL
// stream) is one more FIFO. An event captures (stream, count of operations queued there) at its record;
// it is complete when that stream has completed that many, or when never recorded. Completions are
// logged ("  .. done op N 'tag' on stream S") as they happen: at a release, a query, a synchronize.
// Capture: while a thread captures a stream in GLOBAL mode, a potentially unsafe call (event or stream
// or context synchronize, event query) from any thread whose mode is not RELAXED invalidates it (the
// call fails with 900 and the log says "!! capture invalidated"); cuStreamEndCapture then fails (901).
#define MAXS 256
#define MAXOPS 4096
#define MAXE 8192
enum { OP_KERNEL = 1, OP_WAIT_EVENT, OP_WAIT_VALUE, OP_WRITE_VALUE, OP_COPY };
typedef struct {
    int kind, released;
    char tag[48];
    int dep_stream, dep_seq;
    u64* addr;
    u64 value;
    unsigned flags;
    void* dst;  // OP_COPY: n bytes from src, read when the stream reaches it
    const void* src;
    size_t n;
} op_t;
typedef struct {
    int used;
    void* ctx;
    int nops, ndone;
    op_t ops[MAXOPS];
    int capturing, capture_mode, invalidated;
    unsigned flags;  // CU_STREAM_NON_BLOCKING (1) or not: a blocking stream syncs with the legacy stream
} stream_t;
typedef struct {
    int used, recorded, stream, seq;
    void* ctx;
    unsigned flags;
} event_t;
static stream_t streams[MAXS];
static event_t events[MAXE];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static __thread int thread_mode = 0;  // CU_STREAM_CAPTURE_MODE_GLOBAL
static int nglobal_captures = 0;

#define SH(i) ((void*)(uintptr_t)(0x5000 + (i)))
#define EH(i) ((void*)(uintptr_t)(0x90000 + (i)))

static int sidx(void* s) {
    if (!s || s == (void*)1 || s == (void*)2) {  // NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
        streams[0].used = 1;
        return 0;
    }
    int i = (int)((uintptr_t)s - 0x5000);
    return (i > 0 && i < MAXS && streams[i].used) ? i : -1;
}
static int eidx(void* e) {
    int i = (int)((uintptr_t)e - 0x90000);
    return (i >= 0 && i < MAXE && events[i].used) ? i : -1;
}
static int stream_done_upto(int s, int seq) { return streams[s].ndone >= seq; }
static int event_done(int e) { return !events[e].recorded || stream_done_upto(events[e].stream, events[e].seq); }

static int op_ready(op_t* o) {
    switch (o->kind) {
        case OP_KERNEL: return o->released;
        case OP_WAIT_EVENT: return stream_done_upto(o->dep_stream, o->dep_seq);
        case OP_WAIT_VALUE: {
            u64 v = __atomic_load_n(o->addr, __ATOMIC_ACQUIRE);
            switch (o->flags & 0xf) {
                case 0: return (int64_t)(v - o->value) >= 0;  // GEQ
                case 1: return v == o->value;                 // EQ
                case 2: return (v & o->value) != 0;           // AND
                default: return (v | o->value) != ~0ULL;      // NOR
            }
        }
        default: return 1;
    }
}
static void progress(void) {  // under mu
    int changed = 1;
    while (changed) {
        changed = 0;
        for (int s = 0; s < MAXS; s++) {
            stream_t* st = &streams[s];
            while (st->used && !st->capturing && st->ndone < st->nops && op_ready(&st->ops[st->ndone])) {
                op_t* o = &st->ops[st->ndone];
                if (o->kind == OP_WRITE_VALUE) __atomic_store_n(o->addr, o->value, __ATOMIC_RELEASE);
                if (o->kind == OP_COPY) memcpy(o->dst, o->src, o->n);
                st->ndone++;
                changed = 1;
                fprintf(L(), "  .. done op %d '%s' on stream %d\n", st->ndone, o->tag, s);
            }
        }
    }
    pthread_cond_broadcast(&cv);
}
static op_t* enqueue(int s, int kind, const char* tag) {  // under mu
    stream_t* st = &streams[s];
    if (st->nops >= MAXOPS) return NULL;
    op_t* o = &st->ops[st->nops++];
    memset(o, 0, sizeof *o);
    o->kind = kind;
    snprintf(o->tag, sizeof o->tag, "%s", tag);
    return o;
}
// A potentially unsafe call while a GLOBAL-mode capture runs: invalidates it unless this thread is RELAXED.
static int unsafe(const char* call) {  // under mu
    if (!nglobal_captures || thread_mode == 2) return 0;
    for (int s = 0; s < MAXS; s++)
        if (streams[s].capturing && streams[s].capture_mode == 0) streams[s].invalidated = 1;
    fprintf(L(), "  !! capture invalidated by %s (thread capture mode %d)\n", call, thread_mode);
    return 1;
}
static int nwaiting = 0;  // threads in a host wait (a synchronize) that has not returned: fake_waiting
static void wait_until(int (*done)(int), int arg) {  // under mu; a word another process writes needs polls
    for (int first = 1;; first = 0) {
        progress();
        if (done(arg)) {
            if (!first) nwaiting--;
            return;
        }
        if (first) nwaiting++;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 1000000;
        if (ts.tv_nsec >= 1000000000) { ts.tv_sec++; ts.tv_nsec -= 1000000000; }
        pthread_cond_timedwait(&cv, &mu, &ts);
    }
}
static int stream_idle(int s) { return streams[s].ndone == streams[s].nops; }
static int ctx_idle(int c) {
    for (int s = 0; s < MAXS; s++)
        if (streams[s].used && (uintptr_t)streams[s].ctx == (uintptr_t)c && !stream_idle(s)) return 0;
    return 1;
}

CUresult cuStreamCreate(void** out, unsigned flags) {
    if (!cur) return 201;
    pthread_mutex_lock(&mu);
    int i = 1;
    while (i < MAXS && streams[i].used) i++;
    if (i == MAXS) { pthread_mutex_unlock(&mu); return 2; }
    memset(&streams[i], 0, sizeof streams[i]);
    streams[i].used = 1;
    streams[i].ctx = cur;
    streams[i].flags = flags;
    *out = SH(i);
    fprintf(L(), "cuStreamCreate() -> stream %d\n", i);
    CUR();
    pthread_mutex_unlock(&mu);
    return 0;
}
CUresult cuStreamCreateWithPriority(void** out, unsigned flags, int prio) { return cuStreamCreate(out, flags); }
CUresult cuStreamDestroy_v2(void* s) {
    pthread_mutex_lock(&mu);
    int i = sidx(s);
    if (i > 0) streams[i].used = 0;
    pthread_mutex_unlock(&mu);
    return i > 0 ? 0 : 400;
}
CUresult cuStreamDestroy(void* s) { return cuStreamDestroy_v2(s); }

CUresult cuEventCreate(void** out, unsigned flags) {
    if (!cur) { fprintf(L(), "cuEventCreate(flags=%u) with no context current\n", flags); return 201; }
    pthread_mutex_lock(&mu);
    int i = 0;
    while (i < MAXE && events[i].used) i++;
    if (i == MAXE) { pthread_mutex_unlock(&mu); return 2; }
    memset(&events[i], 0, sizeof events[i]);
    events[i].used = 1;
    events[i].ctx = cur;
    events[i].flags = flags;
    *out = EH(i);
    fprintf(L(), "cuEventCreate(flags=%u) -> event %d\n", flags, i);
    CUR();
    pthread_mutex_unlock(&mu);
    return 0;
}
CUresult cuEventDestroy_v2(void* e) {
    pthread_mutex_lock(&mu);
    int i = eidx(e);
    if (i >= 0) events[i].used = 0;
    fprintf(L(), "cuEventDestroy(event %d)\n", i);
    pthread_mutex_unlock(&mu);
    return i >= 0 ? 0 : 400;
}
CUresult cuEventDestroy(void* e) { return cuEventDestroy_v2(e); }
CUresult cuEventRecordWithFlags(void* e, void* s, unsigned flags) {
    pthread_mutex_lock(&mu);
    int i = eidx(e), k = sidx(s);
    CUresult r = 0;
    if (i < 0 || k < 0) r = 400;
    else {
        void* sctx = k == 0 ? cur : streams[k].ctx;
        fprintf(L(), "cuEventRecord(event %d, stream %d) after %d op(s)%s\n", i, k, streams[k].nops,
                streams[k].capturing ? " [captured into the graph]" : "");
        if (sctx != events[i].ctx) {
            fprintf(L(), "  !! event of ctx %p recorded on a stream of ctx %p\n", events[i].ctx, sctx);
            r = 400;
        } else {
            events[i].recorded = 1;
            events[i].stream = k;
            events[i].seq = streams[k].nops;
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuEventRecord(void* e, void* s) { return cuEventRecordWithFlags(e, s, 0); }
CUresult cuEventQuery(void* e) {
    pthread_mutex_lock(&mu);
    int i = eidx(e);
    CUresult r;
    if (i < 0) r = 400;
    else if (unsafe("cuEventQuery")) r = 900;
    else { progress(); r = event_done(i) ? 0 : 600; }
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuEventSynchronize(void* e) {
    pthread_mutex_lock(&mu);
    int i = eidx(e);
    CUresult r = 0;
    if (i < 0) r = 400;
    else {
        fprintf(L(), "cuEventSynchronize(event %d)\n", i);
        CUR();
        if (!cur) { fprintf(L(), "  !! no context current\n"); r = 201; }
        else if (cur != events[i].ctx) fprintf(L(), "  !! event of ctx %p synchronised with ctx %p current\n",
                                             events[i].ctx, cur);
        if (!r && unsafe("cuEventSynchronize")) r = 900;
        if (!r) {
            wait_until(event_done, i);
            fprintf(L(), "cuEventSynchronize(event %d) returned\n", i);
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuStreamWaitEvent(void* s, void* e, unsigned flags) {
    pthread_mutex_lock(&mu);
    int k = sidx(s), i = eidx(e);
    CUresult r = 0;
    if (k < 0 || i < 0) r = 400;
    else {
        fprintf(L(), "cuStreamWaitEvent(stream %d, event %d)\n", k, i);
        if (events[i].recorded) {
            op_t* o = enqueue(k, OP_WAIT_EVENT, "wait event");
            o->dep_stream = events[i].stream;
            o->dep_seq = events[i].seq;
            snprintf(o->tag, sizeof o->tag, "wait event %d", i);
            progress();
        }
    }
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuStreamQuery(void* s) {
    pthread_mutex_lock(&mu);
    int k = sidx(s);
    CUresult r = k < 0 ? 400 : unsafe("cuStreamQuery") ? 900 : (progress(), stream_idle(k) ? 0 : 600);
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuStreamSynchronize(void* s) {
    pthread_mutex_lock(&mu);
    int k = sidx(s);
    CUresult r = 0;
    fprintf(L(), "cuStreamSynchronize(stream %d)\n", k);
    if (k < 0) r = 400;
    else if (unsafe("cuStreamSynchronize")) r = 900;
    else wait_until(stream_idle, k);
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuCtxSynchronize(void) {
    pthread_mutex_lock(&mu);
    fprintf(L(), "cuCtxSynchronize()\n");
    CUR();
    CUresult r = cur ? 0 : 201;
    if (!r && unsafe("cuCtxSynchronize")) r = 900;
    if (!r) wait_until(ctx_idle, (int)(uintptr_t)cur);
    pthread_mutex_unlock(&mu);
    return r;
}
CUresult cuStreamWriteValue64_v2(void* s, u64 addr, u64 value, unsigned flags) {
    pthread_mutex_lock(&mu);
    int k = sidx(s);
    if (k >= 0) {
        char tag[48];
        snprintf(tag, 48, "write %#llx=%llu", addr, value);
        op_t* o = enqueue(k, OP_WRITE_VALUE, tag);
        o->addr = (u64*)(uintptr_t)addr;
        o->value = value;
        fprintf(L(), "cuStreamWriteValue64(stream %d, %#llx, %llu)\n", k, addr, value);
        progress();
    }
    pthread_mutex_unlock(&mu);
    return k >= 0 ? 0 : 400;
}
CUresult cuStreamWriteValue64(void* s, u64 addr, u64 value, unsigned flags) {
    return cuStreamWriteValue64_v2(s, addr, value, flags);
}
CUresult cuStreamWaitValue64_v2(void* s, u64 addr, u64 value, unsigned flags) {
    pthread_mutex_lock(&mu);
    int k = sidx(s);
    if (k >= 0) {
        char tag[48];
        snprintf(tag, 48, "wait %#llx=%llu", addr, value);
        op_t* o = enqueue(k, OP_WAIT_VALUE, tag);
        o->addr = (u64*)(uintptr_t)addr;
        o->value = value;
        o->flags = flags;
        fprintf(L(), "cuStreamWaitValue64(stream %d, %#llx, %llu, flags=%u)\n", k, addr, value, flags);
        progress();
    }
    pthread_mutex_unlock(&mu);
    return k >= 0 ? 0 : 400;
}
CUresult cuStreamWaitValue64(void* s, u64 addr, u64 value, unsigned flags) {
    return cuStreamWaitValue64_v2(s, addr, value, flags);
}
// Registering host memory and asking its device address are treated as potentially unsafe during a
// global-mode capture (NCCL runs both in relaxed mode), as cuEventQuery is.
CUresult cuMemHostGetDevicePointer_v2(u64* d, void* p, unsigned flags) {
    pthread_mutex_lock(&mu);
    int bad = unsafe("cuMemHostGetDevicePointer");
    pthread_mutex_unlock(&mu);
    if (bad) return 900;
    *d = (u64)(uintptr_t)p;
    return 0;
}
CUresult cuMemHostGetDevicePointer(u64* d, void* p, unsigned flags) { return cuMemHostGetDevicePointer_v2(d, p, flags); }

CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
    int old = thread_mode;
    thread_mode = *mode;
    *mode = old;
    fprintf(L(), "cuThreadExchangeStreamCaptureMode(%d -> %d)\n", old, thread_mode);
    return 0;
}
CUresult cuStreamBeginCapture_v2(void* s, int mode) {
    pthread_mutex_lock(&mu);
    int k = sidx(s);
    if (k > 0) {
        streams[k].capturing = 1;
        streams[k].capture_mode = mode;
        streams[k].invalidated = 0;
        if (mode == 0) nglobal_captures++;
        fprintf(L(), "cuStreamBeginCapture(stream %d, mode %d)\n", k, mode);
    }
    pthread_mutex_unlock(&mu);
    return k > 0 ? 0 : 400;
}
CUresult cuStreamBeginCapture(void* s, int mode) { return cuStreamBeginCapture_v2(s, mode); }
CUresult cuStreamEndCapture(void* s, void** graph) {
    pthread_mutex_lock(&mu);
    int k = sidx(s);
    CUresult r = 400;
    if (k > 0 && streams[k].capturing) {
        streams[k].capturing = 0;
        if (streams[k].capture_mode == 0) nglobal_captures--;
        streams[k].nops = streams[k].ndone;  // captured work is not run
        r = streams[k].invalidated ? 901 : 0;
        *graph = (void*)(uintptr_t)0x6000;
        fprintf(L(), "cuStreamEndCapture(stream %d) -> %s\n", k, r ? "INVALIDATED" : "ok");
    }
    pthread_mutex_unlock(&mu);
    return r;
}
// The legacy stream's answer while a blocking stream of the current context captures is an error
// (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, 906), as the driver documents: the two would synchronise.
CUresult cuStreamIsCapturing(void* s, int* status) {
    pthread_mutex_lock(&mu);
    int k = sidx(s);
    *status = k >= 0 && streams[k].capturing ? (streams[k].invalidated ? 2 : 1) : 0;
    CUresult r = k >= 0 ? 0 : 400;
    if (k == 0 && (s == 0 || s == (void*)1))
        for (int i = 1; i < MAXS; i++)
            if (streams[i].used && streams[i].ctx == cur && !(streams[i].flags & 1) && streams[i].capturing) r = 906;
    pthread_mutex_unlock(&mu);
    return r;
}

// The test's own calls (ctypes): GPU work that stays queued until the test releases it.
int fake_launch(void* s, const char* tag) {
    pthread_mutex_lock(&mu);
    int k = sidx(s);
    op_t* o = k >= 0 ? enqueue(k, OP_KERNEL, tag) : NULL;
    if (o) fprintf(L(), "launch '%s' on stream %d\n", tag, k);
    pthread_mutex_unlock(&mu);
    return o ? 0 : -1;
}
// A copy of n bytes of host memory, run in its stream's order as a DMA: the bytes are read from src when
// the stream reaches it (at once on an idle stream), not when it is queued. Both buffers must outlive it.
int fake_copy(void* s, void* dst, const void* src, size_t n, const char* tag) {
    pthread_mutex_lock(&mu);
    int k = sidx(s);
    op_t* o = k >= 0 ? enqueue(k, OP_COPY, tag) : NULL;
    if (o) {
        o->dst = dst;
        o->src = src;
        o->n = n;
        fprintf(L(), "copy %zu bytes '%s' on stream %d\n", n, tag, k);
        progress();
    }
    pthread_mutex_unlock(&mu);
    return o ? 0 : -1;
}
int fake_release(const char* tag) {
    pthread_mutex_lock(&mu);
    int n = 0;
    fprintf(L(), "release '%s'\n", tag);
    for (int s = 0; s < MAXS; s++)
        for (int j = streams[s].ndone; streams[s].used && j < streams[s].nops; j++)
            if (streams[s].ops[j].kind == OP_KERNEL && !strcmp(streams[s].ops[j].tag, tag)) {
                streams[s].ops[j].released = 1;
                n++;
            }
    progress();
    pthread_mutex_unlock(&mu);
    return n;
}
int fake_waiting(void) {
    pthread_mutex_lock(&mu);
    int n = nwaiting;
    pthread_mutex_unlock(&mu);
    return n;
}
int fake_stream_pending(void* s) {
    pthread_mutex_lock(&mu);
    int k = sidx(s);
    if (k >= 0) progress();
    int n = k >= 0 ? streams[k].nops - streams[k].ndone : -1;
    pthread_mutex_unlock(&mu);
    return n;
}

// cuda-bindings resolves every entry point through here: answer with this library's own symbols.
CUresult cuGetProcAddress_v2(const char* sym, void** pfn, int ver, u64 flags, int* status) {
    static void* self;
    if (!self) self = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    char name[256];
    void* f = NULL;
    if (self) {
        snprintf(name, 256, "%s_v2", sym);
        f = dlsym(self, name);
        if (!f) f = dlsym(self, sym);
    }
    if (f == (void*)cuGetProcAddress_v2 && strcmp(sym, "cuGetProcAddress")) f = NULL;
    *pfn = f;
    if (status) *status = f ? 0 : 1;
    return f ? 0 : 500;
}
CUresult cuGetProcAddress(const char* sym, void** pfn, int ver, u64 flags, int* status) {
    return cuGetProcAddress_v2(sym, pfn, ver, flags, status);
}
