/* runplane's spawn helper (executor/spawnhelper.py): the few steps between the executor
 * and a job's own process, each done by one exec of this small static program instead of
 * a dynamically linked tool and a shell (issue 26: every exec of the chain costs CPU per
 * job process). It does exactly what the tools it stands in for did, and nothing else:
 *
 *   --reuid=U --regid=U --clear-groups --no-new-privs --pdeathsig SIG runplane-spawn PPID
 *       FILE... -- LIMIT... -- ARGV...
 *     what `setpriv` and the exec chain's shell did (executor/spawn.py CHAIN): the ids
 *     (real, effective and saved) and no supplementary group, no_new_privs, the parent
 *     death signal SIG (KILL or TERM) set after the switch; then, as the job, its parent
 *     must still be PPID (the executor: one that died before the signal was set would
 *     never send it), it joins each control group FILE (a `cgroup.procs` delegated to its
 *     uid), takes each LIMIT (`t=SOFT:HARD`, the `ulimit` letter, `-` for unlimited) and
 *     executes ARGV. Any step that fails: exit 125, nothing executed.
 *   --pdeathsig SIG -- ARGV...      what `setpriv --pdeathsig SIG --` did
 *   --default-signal=INT,QUIT -- ARGV...   what `env --default-signal=INT,QUIT --` did
 *   --statfs PATH...                what `stat -f -c 'tmpfs %n %a %b' PATH...` printed
 *
 * ARGV[0] is looked up in PATH when it has no slash, as by the tools. Built static, so
 * that its exec loads nothing: `cc -static -O2`. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/statfs.h>
#include <unistd.h>

#define FAIL 125

static int fail(const char *what) {
  dprintf(2, "runplane-spawn: %s: %s\n", what, strerror(errno));
  return FAIL;
}

static int number(const char *text, unsigned long long *out) {
  char *end = NULL;
  if (text[0] < '0' || text[0] > '9') return 0;
  errno = 0;
  *out = strtoull(text, &end, 10);
  return errno == 0 && *end == '\0';
}

static int signal_of(const char *name) {
  if (strcmp(name, "KILL") == 0) return SIGKILL;
  if (strcmp(name, "TERM") == 0) return SIGTERM;
  return 0;
}

static int run(char **argv) {
  if (argv[0] == NULL || argv[0][0] == '\0') {
    errno = EINVAL;
    return fail("nothing to execute");
  }
  execvp(argv[0], argv); /* as setpriv and env did: a name without a slash, by PATH */
  int code = errno == ENOENT ? 127 : 126;
  dprintf(2, "runplane-spawn: %s: %s\n", argv[0], strerror(errno));
  return code;
}

static int resource_of(char letter) {
  switch (letter) {
    case 't': return RLIMIT_CPU;
    case 'f': return RLIMIT_FSIZE;
    case 'c': return RLIMIT_CORE;
    case 'n': return RLIMIT_NOFILE;
    case 'd': return RLIMIT_DATA;
    case 'p': return RLIMIT_NPROC;
    default: return -1;
  }
}

static int limit_value(const char *text, rlim_t *out) {
  unsigned long long value;
  if (strcmp(text, "-") == 0) {
    *out = RLIM_INFINITY;
    return 1;
  }
  if (!number(text, &value)) return 0;
  *out = (rlim_t)value;
  return 1;
}

/* `t=SOFT:HARD` */
static int take_limit(const char *spec) {
  char soft[32], hard[32];
  const char *colon = strchr(spec, ':');
  int which = resource_of(spec[0]);
  struct rlimit value;
  if (which < 0 || spec[1] != '=' || colon == NULL) return 0;
  size_t a = (size_t)(colon - spec - 2), b = strlen(colon + 1);
  if (a == 0 || a >= sizeof soft || b == 0 || b >= sizeof hard) return 0;
  memcpy(soft, spec + 2, a);
  soft[a] = '\0';
  memcpy(hard, colon + 1, b + 1);
  if (!limit_value(soft, &value.rlim_cur) || !limit_value(hard, &value.rlim_max)) return 0;
  return setrlimit(which, &value) == 0;
}

static int join(const char *procs) {
  int fd = open(procs, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return 0;
  int done = write(fd, "0", 1) == 1;
  return close(fd) == 0 && done;
}

static int chain(int argc, char **argv) {
  unsigned long long uid, gid, parent;
  int i, sig;
  if (argc < 10 || strncmp(argv[1], "--reuid=", 8) != 0 || strncmp(argv[2], "--regid=", 8) != 0 ||
      !number(argv[1] + 8, &uid) || !number(argv[2] + 8, &gid) ||
      strcmp(argv[3], "--clear-groups") != 0 || strcmp(argv[4], "--no-new-privs") != 0 ||
      strcmp(argv[5], "--pdeathsig") != 0 || !(sig = signal_of(argv[6])) ||
      strcmp(argv[7], "runplane-spawn") != 0 || !number(argv[8], &parent) || uid == 0 ||
      gid == 0 || uid > 0xfffffffeULL || gid > 0xfffffffeULL) {
    errno = EINVAL;
    return fail("usage");
  }
  if (setgroups(0, NULL) != 0) return fail("setgroups");
  if (setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) != 0) return fail("setresgid");
  if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) != 0) return fail("setresuid");
  if (getuid() != uid || geteuid() != uid || getgid() != gid || getegid() != gid) {
    errno = EPERM;
    return fail("ids");
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return fail("no_new_privs");
  if (prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0) return fail("pdeathsig");
  if ((unsigned long long)getppid() != parent) return FAIL;  /* the executor is gone */
  for (i = 9; i < argc && strcmp(argv[i], "--") != 0; i++)
    if (!join(argv[i])) return fail(argv[i]);
  for (i++; i < argc && strcmp(argv[i], "--") != 0; i++)
    if (!take_limit(argv[i])) return fail(argv[i]);
  if (i >= argc) {
    errno = EINVAL;
    return fail("usage");
  }
  return run(argv + i + 1);
}

static int statfs_of(int argc, char **argv) {
  int code = 0;
  for (int i = 2; i < argc; i++) {
    struct statfs s;
    if (statfs(argv[i], &s) != 0) {
      code = 1;
      continue;
    }
    printf("tmpfs %s %llu %llu\n", argv[i], (unsigned long long)s.f_bavail,
           (unsigned long long)s.f_blocks);
  }
  return fflush(stdout) == 0 ? code : 1;
}

int main(int argc, char **argv) {
  if (argc >= 2 && strncmp(argv[1], "--reuid=", 8) == 0) return chain(argc, argv);
  if (argc >= 5 && strcmp(argv[1], "--pdeathsig") == 0 && strcmp(argv[3], "--") == 0) {
    int sig = signal_of(argv[2]);
    if (!sig) {
      errno = EINVAL;
      return fail("usage");
    }
    if (prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0) return fail("pdeathsig");
    return run(argv + 4);
  }
  if (argc >= 4 && strcmp(argv[1], "--default-signal=INT,QUIT") == 0 &&
      strcmp(argv[2], "--") == 0) {
    if (signal(SIGINT, SIG_DFL) == SIG_ERR || signal(SIGQUIT, SIG_DFL) == SIG_ERR)
      return fail("signal");
    return run(argv + 3);
  }
  if (argc >= 2 && strcmp(argv[1], "--statfs") == 0) return statfs_of(argc, argv);
  errno = EINVAL;
  return fail("usage");
}
